//! A pool whose page bytes live in GPU memory (`CudaPages`) keeps every
//! rule the staged stand-in keeps in `tests/isolation/device_resident_pages`:
//! the same story body, on the device. Prints SKIP without a GPU.
#![cfg(feature = "cuda")]

use handoff::backend::cuda::{CudaPages, device_for_test};
use handoff::{KvPool, PoolConfig};

#[test]
fn cuda_pages_keep_every_rule_of_a_pool() {
    let Some(dev) = device_for_test("cuda_pages_keep_every_rule_of_a_pool") else {
        return;
    };
    crate::support::device_pages::device_pages_keep_every_rule(&|cfg: PoolConfig| {
        let pages = CudaPages::alloc(&dev, cfg.storage_bytes().unwrap()).unwrap();
        KvPool::with_device_pages(cfg, Box::new(pages)).unwrap()
    });
}
