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
/// (1.4 MB of KV, about 1,400 READs): every byte lands where planned.
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

/// Prefill pages of 16 tokens, decode pages of 8, so each batch's spans
/// at the two ends are cut at different places; first in host memory (the
/// decode end READs straight into its pages), then in device memory on
/// both ends (staged devices: this transport registers host memory only,
/// so the prefill end copies each batch into its registered send buffer,
/// the decode end READs it into its registered landing buffer and the
/// landing zone copies it into the device pages). Every prompt verifies
/// with the pages holding what prefill computed, and both pools return to
/// full.
#[test]
fn pages_cut_differently_or_on_devices_land_intact() {
    on_nixl!(|t| {
        use crate::support::device_pages::SharedStaged;
        use handoff::{KvDtype, KvPool, PoolConfig};
        let cfg = TransferConfig::default().with_max_batch_bytes(4 << 10);
        let spec = support::RigSpec {
            decode_page: 8,
            decode_pages: 64,
            ..support::RigSpec::default()
        };
        let g = support::geometry(KvDtype::BF16);
        for device in [false, true] {
            let pcfg = PoolConfig::new(g, spec.prefill_page, spec.prefill_pages);
            let dcfg = PoolConfig::new(g, spec.decode_page, spec.decode_pages);
            let (prefill_pool, decode_pool) = if device {
                let p = SharedStaged::new(pcfg.storage_bytes().unwrap(), false);
                let d = SharedStaged::new(dcfg.storage_bytes().unwrap(), false);
                (
                    KvPool::with_device_pages(pcfg, Box::new(p.handle())).unwrap(),
                    KvPool::with_device_pages(dcfg, Box::new(d.handle())).unwrap(),
                )
            } else {
                (KvPool::new(pcfg).unwrap(), KvPool::new(dcfg).unwrap())
            };
            let mut rig = support::rig_over(&t, cfg.clone(), prefill_pool, decode_pool, &spec);
            for id in 1..=3u64 {
                let _ = rig
                    .decode
                    .submit(support::request(id, id as u32, 100))
                    .unwrap();
                rig.serve_one().unwrap();
                let o = rig.outcomes(1).pop().expect("an outcome");
                let v = o
                    .result
                    .unwrap_or_else(|e| panic!("device {device}, {id}: {e}"));
                assert_eq!(v.seq().complete_len(), Some(100));
                assert_eq!(
                    handoff::transfer::synthetic::check(&rig.decode_pool, v.seq(), o.request)
                        .unwrap(),
                    Ok(())
                );
                drop(v);
                rig.settle();
            }
            rig.assert_clean();
        }
    });
}
