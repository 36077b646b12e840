//! A drafting request's own tokens never enter the prefix cache: it
//! publishes the pages of the prompt, as an undrafted request does, and no
//! page holding a drafted (accepted or rolled-back) row is ever offered to
//! another request of the tenant.

use std::path::Path;

use handoff::model::{Model, load_llama2c};
use handoff::request::SpecConfig;
use handoff::{
    Engine, EngineConfig, EngineOptions, FinishReason, KvDtype, Outcome, Request, RequestId,
    TenantId,
};

const STORIES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../shared/models/stories260K.bin"
);

#[test]
fn drafted_tokens_are_never_published_to_the_prefix_cache() {
    if !Path::new(STORIES).exists() {
        eprintln!("SKIP: {STORIES} is absent");
        return;
    }
    let model = Model::cpu(load_llama2c(Path::new(STORIES)).unwrap()).unwrap();
    let cfg = EngineConfig::colocated(model.kv_geometry(KvDtype::F32))
        .max_context(128)
        .page_size(4)
        .pool_tokens(1024)
        .build()
        .unwrap();
    let opts = EngineOptions {
        prefix_cache: true,
        ..EngineOptions::default()
    };
    let mut e = Engine::with_options(model, cfg, opts).unwrap();
    // A prompt that repeats itself, so prompt lookup finds drafts that hold;
    // 22 tokens: 5 whole pages of 4, and a sixth shared with the output.
    let phrase = [1u32, 40, 73, 105, 29, 11];
    let prompt: Vec<u32> = phrase.iter().cycle().take(22).copied().collect();
    let req = Request::new(RequestId(1), TenantId(7), prompt.clone(), 24)
        .with_speculative(SpecConfig::prompt_lookup(1, 3, 5));
    let h = e.submit(req).unwrap();
    e.run_until_idle();
    let (out, outcome) = h.try_collect();
    assert_eq!(outcome, Some(Outcome::Finished(FinishReason::Length)));
    let t = e.tally();
    assert!(t.accepted > 0, "drafts were kept: {t:?}");

    let cache = e.prefix_cache().expect("the prefix cache is on");
    let prompt_hit = cache.probe(&cache.keys(TenantId(7), &prompt));
    assert!(prompt_hit > 0, "the prompt's pages were published");
    let mut whole = prompt.clone();
    whole.extend_from_slice(&out);
    let whole_hit = cache.probe(&cache.keys(TenantId(7), &whole));
    assert_eq!(
        whole_hit, 5,
        "only the prompt's whole pages are cached: none holding a drafted or generated token"
    );
    let stats = e.pool_stats();
    assert_eq!(stats.isolation_violations, 0);
}
