//! Story: NIXL moves the bytes; the sealed link decides what they mean.
//!
//! The NIXL transport is authenticated TCP with a data plane beside it.
//! Its ends must agree on that: a NIXL prefill end facing a decode end that
//! offers no data plane gives up with a typed error within the auth
//! timeout instead of writing anywhere, and a plain prefill end facing a
//! NIXL decode end refuses the unexpected data-plane frame and closes. Over
//! a working link, the decode end READs the KV straight into its pages and
//! it lands intact (the conformance suites in `transfer_transports`,
//! `transfer_protocol`, the fault matrices and the PD stories run on NIXL
//! too); here a long transfer runs under a small in-flight cap, and pages
//! cut differently at the two ends, or on (staged) devices, land intact.

// Without the feature each story only prints why it skips.
#[cfg(feature = "nixl")]
use {
    crate::support,
    handoff::transfer::{LinkError, PrefillLink, TcpDecodeListener, TcpPrefill, TransferConfig},
    std::net::SocketAddr,
    std::time::{Duration, Instant},
};

#[cfg(feature = "nixl")]
fn cfg() -> TransferConfig {
    TransferConfig::default().with_auth_timeout(Duration::from_millis(800))
}

#[test]
fn a_nixl_prefill_end_refuses_a_decode_end_without_a_data_plane() {
    on_nixl!(|_| {
        use handoff::transfer::{Nixl, NixlConfig};
        let listener = TcpDecodeListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
        let addr = listener.local_addr().unwrap();
        let decode = std::thread::spawn(move || listener.accept(&cfg()));
        let t0 = Instant::now();
        let nixl = NixlConfig {
            ucx_devices: Some("lo".into()),
        };
        let err = Nixl::connect(addr, None, &cfg(), &nixl)
            .map(|_| ())
            .unwrap_err();
        assert!(
            matches!(err, LinkError::DataPlane { .. }),
            "expected a data-plane error, got {err:?}"
        );
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "gave up within the auth timeout"
        );
        assert_eq!(handoff::HttpStatus::http_status(&err), 502);
        drop(decode.join().unwrap());
    });
}

#[test]
fn a_plain_prefill_end_refuses_a_nixl_decode_end() {
    on_nixl!(|_| {
        use handoff::transfer::{Nixl, NixlConfig, WireError};
        let listener = handoff::transfer::nixl::bind_loopback().unwrap();
        let addr = listener.local_addr().unwrap();
        let decode = std::thread::spawn(move || {
            let nixl = NixlConfig {
                ucx_devices: Some("lo".into()),
            };
            Nixl::accept(&listener, &cfg(), &nixl)
        });
        let mut prefill = TcpPrefill::connect(addr, &cfg()).unwrap();
        let until = Instant::now() + Duration::from_secs(5);
        let err = loop {
            match prefill.recv(Duration::from_millis(100)) {
                Err(e) => break e,
                Ok(_) if Instant::now() < until => {}
                Ok(m) => panic!("the data-plane frame was accepted: {m:?}"),
            }
        };
        assert!(
            matches!(
                err,
                LinkError::Wire(WireError::Unexpected {
                    kind: "data plane",
                    ..
                })
            ),
            "{err:?}"
        );
        drop(decode.join().unwrap());
    });
}

/// The rig's pools, with their pages in host memory or on staged devices
/// (this transport registers host memory only, so device pages go through
/// the two ends' registered buffers).
#[cfg(feature = "nixl")]
fn pools(spec: &support::RigSpec, device: bool) -> (handoff::KvPool, handoff::KvPool) {
    use crate::support::device_pages::SharedStaged;
    use handoff::{KvPool, PoolConfig};
    let g = support::geometry(spec.dtype);
    let pcfg = PoolConfig::new(g, spec.prefill_page, spec.prefill_pages);
    let dcfg = PoolConfig::new(g, spec.decode_page, spec.decode_pages);
    if !device {
        return (KvPool::new(pcfg).unwrap(), KvPool::new(dcfg).unwrap());
    }
    let p = SharedStaged::new(pcfg.storage_bytes().unwrap(), false);
    let d = SharedStaged::new(dcfg.storage_bytes().unwrap(), false);
    (
        KvPool::with_device_pages(pcfg, Box::new(p.handle())).unwrap(),
        KvPool::with_device_pages(dcfg, Box::new(d.handle())).unwrap(),
    )
}

/// Serves `prompts` prompts of `tokens` tokens one by one over a rig on
/// `pools`; each verifies with the pages holding what prefill computed,
/// and both pools are full after.
#[cfg(feature = "nixl")]
fn serve_and_check(
    t: &handoff::transfer::Nixl,
    cfg: TransferConfig,
    spec: &support::RigSpec,
    device: bool,
    prompts: u64,
    tokens: usize,
) {
    let (prefill_pool, decode_pool) = pools(spec, device);
    let mut rig = support::rig_over(t, cfg, prefill_pool, decode_pool, spec);
    for id in 1..=prompts {
        let _ = rig
            .decode
            .submit(support::request(id, id as u32 % 3, tokens))
            .unwrap();
        rig.serve_one().unwrap();
        let o = rig.outcomes(1).pop().expect("an outcome");
        let v = o
            .result
            .unwrap_or_else(|e| panic!("device {device}, prompt {id}: {e}"));
        assert_eq!(v.seq().complete_len(), Some(tokens));
        assert_eq!(
            handoff::transfer::synthetic::check(&rig.decode_pool, v.seq(), o.request).unwrap(),
            Ok(())
        );
        drop(v);
        rig.settle();
    }
    assert_eq!(rig.decode.landing().stray_writes(), 0);
    rig.assert_clean();
}

/// 4 KiB in flight at most, 1 KiB writes, eight prompts of 900 tokens
/// (1.4 MB of KV, about 1,400 READs): every byte lands where planned; with
/// the pages on devices, the prefill end's 4 KiB send buffer wraps about
/// 350 times, each part reused only once the decode end has credited the
/// write it READ from there.
#[test]
fn a_long_run_under_a_small_in_flight_cap_lands_every_byte_intact() {
    on_nixl!(|t| {
        let cfg = TransferConfig::default()
            .with_max_batch_bytes(1 << 10)
            .with_max_in_flight_bytes(4 << 10);
        let spec = support::RigSpec {
            prefill_pages: 64,
            decode_pages: 64,
            prefill_window: 1024,
            decode_window: 1024,
            ..support::RigSpec::default()
        };
        for device in [false, true] {
            serve_and_check(&t, cfg.clone(), &spec, device, 8, 900);
        }
    });
}

/// Prefill pages of 16 tokens, decode pages of 8, so each batch's spans
/// at the two ends are cut at different places; in host memory (the
/// decode end READs straight into its pages), then in device memory on
/// both ends (the prefill end copies each batch into its registered send
/// buffer, the decode end READs it into its registered landing buffer and
/// the landing zone copies it into the device pages).
#[test]
fn pages_cut_differently_or_on_devices_land_intact() {
    on_nixl!(|t| {
        let cfg = TransferConfig::default().with_max_batch_bytes(4 << 10);
        let spec = support::RigSpec {
            decode_page: 8,
            decode_pages: 64,
            ..support::RigSpec::default()
        };
        for device in [false, true] {
            serve_and_check(&t, cfg.clone(), &spec, device, 3, 100);
        }
    });
}
