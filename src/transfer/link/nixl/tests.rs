//! A NIXL peer that lies about its staged writes or its metadata: the
//! decode end ends the link with a typed error or fails the transfer's
//! verification, and both pools return to full.
//! (Honest peers: the conformance suites under `tests/transfer/`.)

use std::path::Path;
use std::time::Duration;

use super::plane::Sender;
use super::{Nixl, NixlConfig, bind_loopback, runtime};
use crate::kv::{Held, KvSeq};
use crate::transfer::link::tcp::frame::Staged;
use crate::transfer::link::tcp::{CreditMark, PlaneSender, TcpPrefill};
use crate::transfer::{
    DecodeSide, LinkError, PrefillSide, TransferConfig, TransferError, WireError, WriteBatch,
    synthetic,
};
use crate::{
    AdmissionLimits, KvDtype, KvGeometry, KvPool, PoolConfig, Request, RequestId, TenantId,
};

/// NIXL for this test, or `None` (printed) when it is not installed.
fn nixl() -> Option<()> {
    let path = std::env::var_os(runtime::LIB_ENV).map_or_else(
        || {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join(".nixl/.nixl_cu12.mesonpy.libs/libnixl_capi.so")
        },
        std::path::PathBuf::from,
    );
    match runtime::load(&path) {
        Ok(()) => Some(()),
        Err(e) if std::env::var_os("HANDOFF_REQUIRE_NIXL").is_some_and(|v| v == "1") => {
            panic!("HANDOFF_REQUIRE_NIXL=1 but {e}")
        }
        Err(e) => {
            eprintln!("SKIP: {e}");
            None
        }
    }
}

/// How the prefill end lies.
#[derive(Clone, Copy)]
enum Lie {
    /// Rewrites each announcement.
    Staged(fn(Staged) -> Staged),
    /// Never sends its metadata.
    NoMetadata,
    /// Sends another agent's metadata.
    OtherAgent,
}

/// An honest sender that lies as `lie` says.
struct Lying {
    honest: Sender,
    lie: Lie,
    /// The other agent, alive while the link is (its metadata must load).
    stranger: Option<(nixl_sys::Agent, nixl_sys::Backend)>,
}

impl PlaneSender for Lying {
    fn send(
        &mut self,
        src: &KvSeq<Held>,
        batch: &WriteBatch,
        row: usize,
        corrupt: bool,
        mark: CreditMark<'_>,
    ) -> Result<Staged, LinkError> {
        let s = self.honest.send(src, batch, row, corrupt, mark)?;
        Ok(match self.lie {
            Lie::Staged(lie) => lie(s),
            _ => s,
        })
    }

    fn metadata(&mut self) -> Result<Option<Vec<u8>>, LinkError> {
        let md = self.honest.metadata()?;
        Ok(match self.lie {
            Lie::NoMetadata => None,
            Lie::OtherAgent if md.is_some() => {
                let stranger = runtime::agent("handoff-prefill-stranger", Some("lo"), false)?;
                let md = stranger.0.get_local_md().map_err(runtime::failed("test"))?;
                self.stranger = Some(stranger);
                Some(md)
            }
            _ => md,
        })
    }
}

/// One 40-token transfer from a prefill end whose announcements `lie`
/// rewrites; returns decode's outcome for it, with both pools full after.
fn transfer_with(lie: Lie) -> Result<(), TransferError> {
    let cfg = TransferConfig::default()
        .with_max_batch_bytes(1 << 10)
        .with_write_timeout(Duration::from_millis(500));
    let nixl = NixlConfig {
        ucx_devices: Some("lo".into()),
    };
    let listener = bind_loopback().unwrap();
    let addr = listener.local_addr().unwrap();
    let (dcfg, dnixl) = (cfg.clone(), nixl.clone());
    let accept = std::thread::spawn(move || Nixl::accept(&listener, &dcfg, &dnixl));
    let cap = cfg.max_in_flight_bytes();
    let make = move |params: &[u8]| {
        let honest = Sender::new(params, cap, Some("lo"))?;
        Ok(Box::new(Lying {
            honest,
            lie,
            stranger: None,
        }) as Box<dyn PlaneSender>)
    };
    let pl = TcpPrefill::connect_with(addr, None, &cfg, Some(&make)).unwrap();
    let dl = accept.join().unwrap().unwrap();
    let g = KvGeometry {
        n_layers: 2,
        n_kv_heads: 2,
        head_dim: 8,
        dtype: KvDtype::BF16,
    };
    let prefill_pool = KvPool::new(PoolConfig::new(g, 16, 8)).unwrap();
    let decode_pool = KvPool::new(PoolConfig::new(g, 16, 8)).unwrap();
    let limits = AdmissionLimits::new(64, 8, 16);
    let mut prefill = PrefillSide::new(pl, prefill_pool.clone(), limits, cfg.clone());
    let mut decode = DecodeSide::new(dl, decode_pool.clone(), limits, cfg);
    let id = RequestId(1);
    let _ticket = decode
        .submit(Request::new(id, TenantId(1), vec![1; 40], 4))
        .unwrap();
    let mut job = prefill.next_job_within(Duration::from_secs(5)).unwrap();
    synthetic::fill(job.seq_mut(), id, 40).unwrap();
    // A lie ends the link; the send may or may not see that yet.
    let _ = prefill.complete(job, None);
    let mut outcome = None;
    for _ in 0..100 {
        if let Some(o) = decode.poll(Duration::from_millis(50)).pop() {
            outcome = Some(o);
            break;
        }
    }
    let result = outcome.expect("an outcome").result.map(drop);
    assert_eq!(decode.stats().verified, u64::from(result.is_ok()));
    drop(decode);
    drop(prefill);
    assert!(decode_pool.stats().is_full(), "{:?}", decode_pool.stats());
    assert!(prefill_pool.stats().is_full(), "{:?}", prefill_pool.stats());
    result
}

#[test]
fn an_honest_nixl_peer_is_verified() {
    if nixl().is_none() {
        return;
    }
    assert_eq!(transfer_with(Lie::Staged(|s| s)), Ok(()));
}

fn assert_data_plane(err: TransferError, want: &str) {
    assert!(
        matches!(&err, TransferError::Link(LinkError::DataPlane { what, .. }) if *what == want),
        "expected {want:?}, got {err:?}"
    );
}

#[test]
fn a_staged_write_naming_memory_the_peer_never_registered_ends_the_link() {
    if nixl().is_none() {
        return;
    }
    let err = transfer_with(Lie::Staged(|s| Staged {
        src: vec![(0x1000, s.len)],
        ..s
    }))
    .unwrap_err();
    assert_data_plane(err, "creating a NIXL READ");
}

#[test]
fn a_staged_write_before_the_peers_metadata_ends_the_link() {
    if nixl().is_none() {
        return;
    }
    let err = transfer_with(Lie::NoMetadata).unwrap_err();
    assert_data_plane(err, "a staged write before the prefill end's NIXL metadata");
}

#[test]
fn metadata_of_another_agent_ends_the_link() {
    if nixl().is_none() {
        return;
    }
    let err = transfer_with(Lie::OtherAgent).unwrap_err();
    assert_data_plane(
        err,
        "NIXL metadata of another agent than the link's prefill end",
    );
}

#[test]
fn a_staged_write_announced_out_of_order_ends_the_link() {
    if nixl().is_none() {
        return;
    }
    let err = transfer_with(Lie::Staged(|s| Staged { id: s.id + 1, ..s })).unwrap_err();
    assert!(
        matches!(
            err,
            TransferError::Link(LinkError::Wire(WireError::Invalid { .. }))
        ),
        "{err:?}"
    );
}

#[test]
fn a_staged_write_announced_at_the_wrong_place_fails_verification_not_isolation() {
    if nixl().is_none() {
        return;
    }
    // The decode end READs from where the peer says the rows are, which is
    // not where they are (V's spans first, then K's): the receipt's
    // checksums catch it.
    let err = transfer_with(Lie::Staged(|mut s| {
        s.src.reverse();
        s
    }))
    .unwrap_err();
    assert!(
        matches!(err, TransferError::Integrity(_)),
        "expected an integrity failure, got {err:?}"
    );
}
