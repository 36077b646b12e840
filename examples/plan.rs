//! Pre-deployment planner: does this KV pool hold this context window?
//!
//! ```text
//! cargo run --release --example plan -- --max-context 1048576 --pool-tokens 2097152
//! ```
//!
//! Prints the plan and exits 0, or prints the refusal (naming both numbers and
//! the fix) and exits 2. Model geometry defaults to Llama-3-8B's KV (32
//! layers, 8 KV heads of 128, bf16); override with the flags below.

use std::process::ExitCode;

use handoff::{
    Colocated, Decode, EngineConfigBuilder, Headroom, KvDtype, KvGeometry, Prefill, Role, RoleKind,
};

const USAGE: &str = "usage: plan --max-context N --pool-tokens M [--role prefill|decode|colocated] \
[--page-size 16] [--layers 32] [--kv-heads 8] [--head-dim 128] [--dtype bf16|f16|f32|fp8] [--headroom 2.0]";

struct Args {
    max_context: usize,
    pool_tokens: usize,
    role: Role,
    page_size: usize,
    geometry: KvGeometry,
    headroom: f64,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        max_context: 0,
        pool_tokens: 0,
        role: Role::Prefill,
        page_size: 16,
        geometry: KvGeometry {
            n_layers: 32,
            n_kv_heads: 8,
            head_dim: 128,
            dtype: KvDtype::BF16,
        },
        headroom: Headroom::DEFAULT.factor(),
    };
    let (mut ctx, mut pool) = (None, None);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            return Err(USAGE.to_string());
        }
        let val = it.next().ok_or(format!("{flag} needs a value\n{USAGE}"))?;
        let num = || -> Result<usize, String> {
            val.parse()
                .map_err(|_| format!("{flag}: {val:?} is not a whole number"))
        };
        match flag.as_str() {
            "--max-context" => ctx = Some(num()?),
            "--pool-tokens" => pool = Some(num()?),
            "--page-size" => a.page_size = num()?,
            "--layers" => a.geometry.n_layers = num()?,
            "--kv-heads" => a.geometry.n_kv_heads = num()?,
            "--head-dim" => a.geometry.head_dim = num()?,
            "--dtype" => {
                a.geometry.dtype = KvDtype::parse(&val)
                    .ok_or(format!("--dtype: {val:?}: use f32, f16, bf16 or fp8"))?
            }
            "--headroom" => {
                a.headroom = val
                    .parse()
                    .map_err(|_| format!("--headroom: {val:?} is not a number"))?
            }
            "--role" => {
                a.role = match val.as_str() {
                    "prefill" => Role::Prefill,
                    "decode" => Role::Decode,
                    "colocated" => Role::Colocated,
                    _ => return Err(format!("--role: {val:?}: use prefill, decode or colocated")),
                }
            }
            _ => return Err(format!("unknown flag {flag}\n{USAGE}")),
        }
    }
    a.max_context = ctx.ok_or(format!("--max-context is required\n{USAGE}"))?;
    a.pool_tokens = pool.ok_or(format!("--pool-tokens is required\n{USAGE}"))?;
    Ok(a)
}

fn gib(bytes: u128) -> f64 {
    bytes as f64 / (1u128 << 30) as f64
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(64);
        }
    };
    let headroom = match Headroom::new(args.headroom) {
        Ok(h) => h,
        Err(e) => {
            eprintln!("refused: {e}");
            return ExitCode::from(2);
        }
    };
    match args.role {
        Role::Colocated => report::<Colocated>(&args, headroom),
        Role::Prefill => report::<Prefill>(&args, headroom),
        Role::Decode => report::<Decode>(&args, headroom),
    }
}

/// Builds the configuration for role `R` and prints what it holds, or the
/// refusal.
fn report<R: RoleKind>(args: &Args, headroom: Headroom) -> ExitCode {
    let built = EngineConfigBuilder::<R>::new(args.geometry)
        .max_context(args.max_context)
        .pool_tokens(args.pool_tokens)
        .page_size(args.page_size)
        .headroom(headroom)
        .build();
    let cfg = match built {
        Ok(cfg) => cfg,
        Err(e) => {
            println!("refused: {e}");
            return ExitCode::from(2);
        }
    };
    let g = cfg.geometry();
    println!("accepted: {:?} worker", cfg.role());
    println!(
        "  model KV        {} layers x {} KV heads x {} head_dim, {:?}",
        g.n_layers, g.n_kv_heads, g.head_dim, g.dtype
    );
    println!("  context window  {} tokens", cfg.max_context());
    println!(
        "  pool            {} tokens = {} pages of {} tokens (headroom {}x)",
        cfg.pool_tokens(),
        cfg.pool_pages(),
        cfg.page_size(),
        cfg.headroom().factor()
    );
    println!("  bytes per token {}", g.bytes_per_token());
    println!("  bytes per page  {}", cfg.bytes_per_page());
    println!(
        "  total KV        {} bytes ({:.2} GiB)",
        cfg.pool_bytes(),
        gib(cfg.pool_bytes())
    );
    println!(
        "  max-length prompts at once: {}",
        cfg.max_length_sequences()
    );
    ExitCode::SUCCESS
}
