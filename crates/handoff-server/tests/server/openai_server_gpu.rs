//! Story: an operator serves a checkpoint on the GPU with `--backend
//! cuda`. Colocated and disaggregated, the server answers greedy
//! completions with the ids transformers recorded for the checkpoint, its
//! KV pages in device memory. Where that cannot be (a build without the
//! `cuda` feature, a machine without a usable GPU) it refuses to start,
//! exit 2, and says why: it never serves from the CPU in the GPU's place.

use crate::support::openai_client;

use std::process::Command;

use openai_client::{Server, post};
use serde_json::json;

/// Whether this test binary can open a GPU (a `cuda` build on a machine
/// with one); with `HANDOFF_REQUIRE_GPU=1` a missing GPU fails instead.
fn gpu() -> bool {
    #[cfg(feature = "cuda")]
    {
        handoff::backend::cuda::device_for_test("handoff-server --backend cuda").is_some()
    }
    #[cfg(not(feature = "cuda"))]
    false
}

#[test]
fn the_gpu_backend_serves_transformers_ids_or_refuses_to_start() {
    if !gpu() {
        let bin = crate::support::server_bin();
        let out = Command::new(&bin)
            .args(["--port", "0", "--backend", "cuda"])
            .output()
            .unwrap();
        crate::support::assert_gpu_refused(&out);
        return;
    }
    for extra in [&[][..], &["--disaggregated"][..]] {
        let fixture = crate::support::hf_fixture();
        let mut args = vec!["--model", fixture.to_str().unwrap(), "--backend", "cuda"];
        args.extend(extra);
        let Some(server) = Server::start(&args) else {
            return;
        };
        assert!(
            server.log().contains("KV pages in device memory"),
            "{}",
            server.log()
        );
        for case in crate::support::hf_expected() {
            let a = post(
                &server,
                "/v1/completions",
                &json!({"prompt": case.prompt, "max_tokens": case.greedy.len(),
                    "temperature": 0}),
                None,
            );
            assert_eq!(a.status, 200, "{extra:?}: {}", a.body);
            let got: Vec<u32> = a.json()["choices"][0]["token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(got, case.greedy, "{extra:?}: prompt {:?}", case.prompt);
        }
    }
}
