//! Story: NIXL moves the bytes; the sealed link decides what they mean.
//!
//! The NIXL transport is authenticated TCP with a data plane beside it.
//! Its ends must agree on that: a NIXL prefill end facing a decode end that
//! offers no data plane gives up with a typed error within the auth
//! timeout instead of writing anywhere, and a plain prefill end facing a
//! NIXL decode end refuses the unexpected data-plane frame and closes. Over
//! a working link, KV crosses by NIXL WRITE and lands intact (the
//! conformance suites in `transfer_transports`, `transfer_protocol`, the
//! fault matrices and the PD stories run on NIXL too); here a long transfer
//! wraps the staging ring many times with a small in-flight cap.

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
        let err = Nixl::connect(addr, &cfg(), &nixl).map(|_| ()).unwrap_err();
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

/// 4 KiB in flight at most, 1 KiB writes, eight prompts of 900 tokens
/// (1.4 MB of KV): the 8 KiB staging ring wraps about 170 times, and every
/// byte lands where planned.
#[test]
fn a_long_run_wraps_the_staging_ring_and_every_byte_lands_intact() {
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
        let mut rig = support::rig(&t, cfg, spec);
        for id in 1..=8u64 {
            let _ = rig
                .decode
                .submit(support::request(id, id as u32 % 3, 900))
                .unwrap();
            rig.serve_one().unwrap();
            let o = rig.outcomes(1).pop().expect("an outcome");
            let v = o.result.unwrap_or_else(|e| panic!("{id}: {e}"));
            assert_eq!(v.seq().complete_len(), Some(900));
            assert_eq!(
                handoff::transfer::synthetic::check(&rig.decode_pool, v.seq(), o.request).unwrap(),
                Ok(())
            );
            drop(v);
            rig.settle();
        }
        assert_eq!(rig.decode.landing().stray_writes(), 0);
        rig.assert_clean();
    });
}
