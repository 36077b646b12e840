//! Fail-closed configuration.
//!
//! An [`EngineConfig`] can only be obtained from [`EngineConfigBuilder::build`],
//! which refuses any deployment whose KV pool cannot hold its context window.
//! There is no switch to turn that check off: the incident this crate exists
//! to prevent began with a 1,048,576-token window served from a 681,280-token
//! prefill pool.

pub mod role;

use std::marker::PhantomData;

use crate::http::HttpStatus;
use crate::kv::PoolError;
pub use crate::kv::{KvDtype, KvGeometry};
use crate::kv::{PoolConfig, ScrubPolicy, pages_for};
pub use role::{Colocated, Decode, Prefill, RoleKind};

/// What a worker does, which decides how much pool it needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Prefill and decode in one engine, one pool.
    Colocated,
    /// Computes prompts' KV and sends it to a decode worker.
    Prefill,
    /// Receives verified KV and generates from it.
    Decode,
}

/// Required pool size as a multiple of the context window, for roles that
/// prefill. The remediation's default is 2x, so that the longest valid prompt
/// always fits while others are in flight; the minimum is 1x.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Headroom(f64);

impl Headroom {
    /// The default: twice the context window.
    pub const DEFAULT: Headroom = Headroom(2.0);
    /// The least allowed: exactly one context window.
    pub const MIN: Headroom = Headroom(1.0);

    /// A headroom factor; refused below 1.0 or when not finite.
    pub fn new(factor: f64) -> Result<Self, ConfigError> {
        if factor.is_finite() && factor >= 1.0 {
            Ok(Headroom(factor))
        } else {
            Err(ConfigError::HeadroomBelowOne { factor })
        }
    }

    /// The factor.
    pub fn factor(self) -> f64 {
        self.0
    }

    /// `ceil(factor * max_context)`, exactly: the factor is `mant * 2^exp`
    /// (a normal f64, being finite and at least 1), so the product is taken
    /// in integers and never rounds down, however large the window.
    fn required_tokens(self, max_context: usize) -> usize {
        let bits = self.0.to_bits();
        let exp = ((bits >> 52) & 0x7ff) as i64 - 1075;
        let mant = u128::from((bits & ((1u64 << 52) - 1)) | (1u64 << 52));
        // < 2^53 * 2^64: no overflow.
        let prod = mant * max_context as u128;
        let tokens = if prod == 0 {
            Some(0)
        } else if exp >= 0 {
            u32::try_from(exp)
                .ok()
                .and_then(|e| 1u128.checked_shl(e))
                .and_then(|scale| prod.checked_mul(scale))
        } else {
            // exp >= -52 for a factor >= 1.
            let shift = exp.unsigned_abs() as u32;
            Some((prod + (1u128 << shift) - 1) >> shift)
        };
        tokens
            .and_then(|t| usize::try_from(t).ok())
            .unwrap_or(usize::MAX)
    }
}

impl Default for Headroom {
    fn default() -> Self {
        Headroom::DEFAULT
    }
}

/// A validated configuration for one server of role `R` ([`Colocated`],
/// [`Prefill`] or [`Decode`]). Fields are private: the only way to get one is
/// a builder ([`EngineConfig::colocated`], [`EngineConfig::prefill`],
/// [`EngineConfig::decode`]) then `build`, which refuses every configuration
/// whose pool cannot hold its context window. Only the server of role `R`
/// accepts it (a compile-time check; see [`role`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineConfig<R: RoleKind> {
    geometry: KvGeometry,
    max_context: usize,
    page_size: usize,
    pool_pages: usize,
    headroom: Headroom,
    audit: bool,
    scrub: ScrubPolicy,
    max_queue: usize,
    role: PhantomData<R>,
}

/// A colocated engine's configuration.
pub type ColocatedConfig = EngineConfig<Colocated>;
/// A prefill worker's configuration.
pub type PrefillConfig = EngineConfig<Prefill>;
/// A decode worker's configuration.
pub type DecodeConfig = EngineConfig<Decode>;

/// Requests that may wait for pages at once unless
/// [`EngineConfigBuilder::max_queue`] says otherwise.
pub const DEFAULT_MAX_QUEUE: usize = 65_536;

impl EngineConfig<Colocated> {
    /// Starts a builder for a colocated `Engine` with the given KV
    /// geometry (its pool must hold 2x the window by default).
    pub fn colocated(geometry: KvGeometry) -> EngineConfigBuilder<Colocated> {
        EngineConfigBuilder::new(geometry)
    }
}

impl EngineConfig<Prefill> {
    /// Starts a builder for a prefill worker with the given KV geometry (its
    /// pool must hold 2x the window by default).
    pub fn prefill(geometry: KvGeometry) -> EngineConfigBuilder<Prefill> {
        EngineConfigBuilder::new(geometry)
    }
}

impl EngineConfig<Decode> {
    /// Starts a builder for a decode worker with the given KV geometry (its
    /// pool must hold the window once: it never prefills).
    pub fn decode(geometry: KvGeometry) -> EngineConfigBuilder<Decode> {
        EngineConfigBuilder::new(geometry)
    }
}

impl<R: RoleKind> EngineConfig<R> {
    pub fn geometry(&self) -> KvGeometry {
        self.geometry
    }
    /// The role this configuration serves (its type parameter, as a value).
    pub fn role(&self) -> Role {
        R::ROLE
    }
    /// The context window: prompt plus generated tokens never exceed it.
    pub fn max_context(&self) -> usize {
        self.max_context
    }
    /// Token slots per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }
    /// Pages in this worker's pool.
    pub fn pool_pages(&self) -> usize {
        self.pool_pages
    }
    /// Token slots in this worker's pool (`pool_pages * page_size`).
    pub fn pool_tokens(&self) -> usize {
        self.pool_pages * self.page_size
    }
    pub fn headroom(&self) -> Headroom {
        self.headroom
    }
    /// Pages one sequence of `tokens` tokens occupies.
    pub fn pages_for(&self, tokens: usize) -> usize {
        pages_for(tokens, self.page_size)
    }
    /// Bytes of one page (all layers, K and V).
    pub fn bytes_per_page(&self) -> usize {
        self.geometry.bytes_per_token() * self.page_size
    }
    /// Bytes of the whole pool.
    pub fn pool_bytes(&self) -> u128 {
        self.bytes_per_page() as u128 * self.pool_pages as u128
    }
    /// How many maximum-length sequences the pool holds at once.
    pub fn max_length_sequences(&self) -> usize {
        self.pool_pages / self.pages_for(self.max_context)
    }
    /// True when this worker's pool keeps the audit trail (see
    /// [`crate::kv::PoolConfig::audit`]).
    pub fn audit(&self) -> bool {
        self.audit
    }
    /// Requests that may wait for pages at once; admission answers the next
    /// one with `QueueFull` (429).
    pub fn max_queue(&self) -> usize {
        self.max_queue
    }
    /// What a released page's bytes become ([`EngineConfigBuilder::scrub`]).
    pub fn scrub(&self) -> ScrubPolicy {
        self.scrub
    }
    /// Pool configuration to build this worker's [`crate::KvPool`] with
    /// (the same as `PoolConfig::from(&cfg)`).
    pub fn pool_config(&self) -> PoolConfig {
        PoolConfig::from(self)
    }
}

impl<R: RoleKind> From<&EngineConfig<R>> for PoolConfig {
    fn from(cfg: &EngineConfig<R>) -> Self {
        PoolConfig::new(cfg.geometry, cfg.page_size, cfg.pool_pages)
            .audit(cfg.audit)
            .scrub(cfg.scrub)
    }
}

/// How the pool's size was given.
#[derive(Clone, Copy, Debug)]
enum PoolSize {
    Tokens(usize),
    Bytes(u64),
}

/// Builder for [`EngineConfig`]`<R>`; see [`EngineConfig::colocated`],
/// [`EngineConfig::prefill`] and [`EngineConfig::decode`].
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until build() is called"]
pub struct EngineConfigBuilder<R: RoleKind> {
    geometry: KvGeometry,
    max_context: Option<usize>,
    page_size: usize,
    pool: Option<PoolSize>,
    headroom: Headroom,
    audit: Option<bool>,
    scrub: ScrubPolicy,
    max_queue: usize,
    role: PhantomData<R>,
}

impl<R: RoleKind> EngineConfigBuilder<R> {
    /// A builder for role `R` (generic code; otherwise start from
    /// [`EngineConfig::colocated`], [`EngineConfig::prefill`] or
    /// [`EngineConfig::decode`]).
    pub fn new(geometry: KvGeometry) -> Self {
        EngineConfigBuilder {
            geometry,
            max_context: None,
            page_size: 16,
            pool: None,
            headroom: Headroom::DEFAULT,
            audit: None,
            scrub: ScrubPolicy::default(),
            max_queue: DEFAULT_MAX_QUEUE,
            role: PhantomData,
        }
    }

    /// The context window in tokens (required).
    pub fn max_context(mut self, tokens: usize) -> Self {
        self.max_context = Some(tokens);
        self
    }
    /// Token slots per page; a power of two. Default 16.
    pub fn page_size(mut self, tokens: usize) -> Self {
        self.page_size = tokens;
        self
    }
    /// Pool capacity in token slots (this or [`Self::pool_memory`] is
    /// required; the last call wins). Rounded down to whole pages.
    pub fn pool_tokens(mut self, tokens: usize) -> Self {
        self.pool = Some(PoolSize::Tokens(tokens));
        self
    }
    /// Pool capacity as a memory budget in bytes: as many whole pages as
    /// fit (for a GPU, the free device memory left after weights and
    /// workspaces). The window check then applies to those pages, and a
    /// budget that cannot hold the window is refused with the bytes it
    /// needs ([`ConfigError::BudgetCannotHoldWindow`]).
    pub fn pool_memory(mut self, bytes: u64) -> Self {
        self.pool = Some(PoolSize::Bytes(bytes));
        self
    }
    /// Required headroom for roles that prefill (default 2x, min 1x).
    pub fn headroom(mut self, headroom: Headroom) -> Self {
        self.headroom = headroom;
        self
    }

    /// Keeps the audit trail (every KV slot records its writer, every read
    /// checks it). Default: on in debug builds and with the `audit` feature.
    pub fn audit(mut self, on: bool) -> Self {
        self.audit = Some(on);
        self
    }

    /// What a page's bytes become when it returns to the pool (default
    /// [`ScrubPolicy::Zero`]). The one place a deployment sets it: the
    /// engine and both workers build their pool with it.
    pub fn scrub(mut self, policy: ScrubPolicy) -> Self {
        self.scrub = policy;
        self
    }

    /// Requests that may wait for pages at once (default
    /// [`DEFAULT_MAX_QUEUE`]); admission refuses the next with `QueueFull`
    /// (429), so a host gets backpressure instead of an ever longer queue.
    /// At least 1.
    pub fn max_queue(mut self, requests: usize) -> Self {
        self.max_queue = requests;
        self
    }

    /// Validates and builds. Refuses a pool that cannot hold the context
    /// window (times the headroom for roles that prefill).
    pub fn build(self) -> Result<EngineConfig<R>, ConfigError> {
        self.geometry.validate()?;
        let max_context = self.max_context.ok_or(ConfigError::Missing {
            field: "max_context",
        })?;
        let pool = self.pool.ok_or(ConfigError::Missing {
            field: "pool_tokens",
        })?;
        if max_context == 0 {
            return Err(ConfigError::Zero {
                field: "max_context",
            });
        }
        if self.max_queue == 0 {
            return Err(ConfigError::Zero { field: "max_queue" });
        }
        if self.page_size == 0 || !self.page_size.is_power_of_two() {
            return Err(ConfigError::PageSizeNotPowerOfTwo {
                page_size: self.page_size,
            });
        }
        if self.page_size > max_context {
            return Err(ConfigError::PageLargerThanWindow {
                page_size: self.page_size,
                max_context,
            });
        }
        let page_bytes =
            (self.geometry.bytes_per_token() as u64).saturating_mul(self.page_size as u64);
        let pool_pages = match pool {
            PoolSize::Tokens(t) => (t / self.page_size) as u64,
            PoolSize::Bytes(b) => b / page_bytes.max(1),
        };
        let pool_pages =
            u32::try_from(pool_pages)
                .map(|p| p as usize)
                .map_err(|_| ConfigError::Overflow {
                    what: "page count (at most u32::MAX pages)",
                })?;
        let pool_tokens = match pool {
            PoolSize::Tokens(t) => t,
            PoolSize::Bytes(_) => pool_pages * self.page_size,
        };
        let headroom = match R::ROLE {
            Role::Colocated | Role::Prefill => self.headroom,
            Role::Decode => Headroom::MIN,
        };
        // Whole pages: a window of N tokens needs ceil(N / page_size) pages.
        let required_pages = pages_for(headroom.required_tokens(max_context), self.page_size);
        if pool_pages < required_pages {
            // The largest window this pool does hold, for the advice: its
            // whole pages over the headroom, lowered until it fits.
            let fits =
                |w: usize| pages_for(headroom.required_tokens(w), self.page_size) <= pool_pages;
            let usable = pool_pages.saturating_mul(self.page_size);
            let mut max_fit = (usable as f64 / headroom.factor()).floor() as usize;
            while max_fit > 0 && !fits(max_fit) {
                max_fit -= 1;
            }
            if let PoolSize::Bytes(budget) = pool {
                return Err(ConfigError::BudgetCannotHoldWindow {
                    role: R::ROLE,
                    budget,
                    max_context,
                    headroom: headroom.factor(),
                    required_bytes: required_pages as u128 * page_bytes as u128,
                    max_fit,
                });
            }
            return Err(ConfigError::PoolCannotHoldWindow {
                role: R::ROLE,
                pool_tokens,
                max_context,
                headroom: headroom.factor(),
                required_tokens: required_pages.saturating_mul(self.page_size),
                max_fit,
            });
        }
        pool_pages
            .checked_mul(self.geometry.bytes_per_token())
            .and_then(|b| b.checked_mul(self.page_size))
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or(ConfigError::Overflow { what: "pool bytes" })?;
        Ok(EngineConfig {
            geometry: self.geometry,
            max_context,
            page_size: self.page_size,
            pool_pages,
            headroom,
            audit: self
                .audit
                .unwrap_or(cfg!(any(debug_assertions, feature = "audit"))),
            scrub: self.scrub,
            max_queue: self.max_queue,
            role: PhantomData,
        })
    }
}

/// Why a configuration was refused. Every variant names the numbers and the
/// fix; none of them can be bypassed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error(
        "{role:?} KV pool of {pool_tokens} tokens cannot hold a context window of {max_context} tokens \
         (needs {headroom}x = {required_tokens} tokens): enlarge the pool to at least {required_tokens} \
         tokens{or_lower}",
        or_lower = if *max_fit > 0 {
            format!(" or lower max_context to at most {max_fit} tokens")
        } else {
            String::new()
        }
    )]
    PoolCannotHoldWindow {
        role: Role,
        pool_tokens: usize,
        max_context: usize,
        headroom: f64,
        required_tokens: usize,
        /// The largest context window this pool holds (0: none).
        max_fit: usize,
    },
    #[error(
        "{role:?} KV pool in a budget of {budget} bytes cannot hold a context window of {max_context} tokens \
         (needs {headroom}x = {required_bytes} bytes of whole pages): give it at least {required_bytes} bytes \
         (free device memory after weights and workspaces){or_lower}",
        or_lower = if *max_fit > 0 {
            format!(" or lower max_context to at most {max_fit} tokens")
        } else {
            String::new()
        }
    )]
    BudgetCannotHoldWindow {
        role: Role,
        budget: u64,
        max_context: usize,
        headroom: f64,
        required_bytes: u128,
        /// The largest context window the budget holds (0: none).
        max_fit: usize,
    },
    #[error("{field} must be set: call the builder's {field}() (or pool_memory()) before build()")]
    Missing { field: &'static str },
    #[error("{field} is zero: every size must be at least 1")]
    Zero { field: &'static str },
    #[error("page_size {page_size} is not a power of two: use 1, 2, 4, ... 16, 64, ...")]
    PageSizeNotPowerOfTwo { page_size: usize },
    #[error(
        "page_size {page_size} is larger than the context window {max_context}: use a smaller page"
    )]
    PageLargerThanWindow {
        page_size: usize,
        max_context: usize,
    },
    #[error(
        "headroom {factor} is not a finite factor of at least 1x: the pool must hold at least one \
         full context window; use Headroom::MIN (1x) or more"
    )]
    HeadroomBelowOne { factor: f64 },
    #[error("{what} overflows: the configuration is too large for this machine")]
    Overflow { what: &'static str },
    /// The pool itself could not be made (its memory, its device): the
    /// kv layer's error, whose message says what to do.
    #[error(transparent)]
    Pool(PoolError),
    #[error("model geometry is inconsistent: {0}")]
    Geometry(String),
}

/// A pool or geometry the kv layer refused, as the deployment error it is:
/// the same variant, numbers and advice.
impl From<PoolError> for ConfigError {
    fn from(e: PoolError) -> Self {
        match e {
            PoolError::Zero { field } => ConfigError::Zero { field },
            PoolError::PageSizeNotPowerOfTwo { page_size } => {
                ConfigError::PageSizeNotPowerOfTwo { page_size }
            }
            PoolError::Overflow { what } => ConfigError::Overflow { what },
            e @ (PoolError::OutOfMemory { .. }
            | PoolError::DeviceTooSmall { .. }
            | PoolError::Device(_)) => ConfigError::Pool(e),
        }
    }
}

impl HttpStatus for ConfigError {
    fn http_status(&self) -> u16 {
        match self {
            // The machine lacks the memory now: another may have it.
            ConfigError::Pool(e) => e.http_status(),
            // A refused deployment is the operator's error, a server fault,
            // as are the engine's and the link's own refusals of a setup.
            _ => 500,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_memory_budget_holds_the_whole_pages_that_fit_and_its_advice_builds() {
        let g = geom();
        let page_bytes = (g.bytes_per_token() * 16) as u64;
        let build = |budget: u64| {
            EngineConfigBuilder::<Colocated>::new(g)
                .max_context(64)
                .page_size(16)
                .pool_memory(budget)
                .build()
        };
        // Ten pages and all but one byte of an eleventh: ten pages.
        let cfg = build(11 * page_bytes - 1).unwrap();
        assert_eq!(cfg.pool_pages(), 10);
        assert_eq!(cfg.pool_bytes(), 10 * page_bytes as u128);
        // A window of 64 at 2x headroom needs 8 pages; 7 hold 56 tokens.
        match build(8 * page_bytes - 1) {
            Err(e @ ConfigError::BudgetCannotHoldWindow { required_bytes, .. }) => {
                assert_eq!(required_bytes, 8 * page_bytes as u128);
                assert!(e.to_string().contains(&required_bytes.to_string()), "{e}");
                assert!(e.to_string().contains("at most 56 tokens"), "{e}");
                assert!(build(required_bytes as u64).is_ok());
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            build(0),
            Err(ConfigError::BudgetCannotHoldWindow { max_fit: 0, .. })
        ));
        // The last size given wins.
        let cfg = EngineConfigBuilder::<Colocated>::new(g)
            .max_context(64)
            .page_size(16)
            .pool_memory(0)
            .pool_tokens(256)
            .build()
            .unwrap();
        assert_eq!(cfg.pool_tokens(), 256);
    }

    #[test]
    fn the_advice_of_a_refused_window_is_a_window_that_builds() {
        // 100 tokens of pool are 6 whole pages of 16: 96 tokens.
        fn build<R: RoleKind>(max_context: usize) -> Result<EngineConfig<R>, ConfigError> {
            EngineConfigBuilder::<R>::new(geom())
                .max_context(max_context)
                .page_size(16)
                .pool_tokens(100)
                .build()
        }
        fn check<R: RoleKind>(want: usize) {
            let role = R::ROLE;
            match build::<R>(120) {
                Err(e @ ConfigError::PoolCannotHoldWindow { max_fit, .. }) => {
                    assert_eq!(max_fit, want, "{role:?}");
                    assert!(
                        e.to_string().contains(&format!("at most {want} tokens")),
                        "{e}"
                    );
                    assert!(build::<R>(max_fit).is_ok());
                    assert!(build::<R>(max_fit + 1).is_err());
                }
                other => panic!("{other:?}"),
            }
        }
        check::<Decode>(96);
        check::<Prefill>(48);
    }

    #[test]
    fn headroom_counts_tokens_exactly() {
        let h = |f: f64| Headroom::new(f).unwrap();
        assert_eq!(h(1.0).required_tokens(100), 100);
        assert_eq!(h(2.0).required_tokens(100), 200);
        assert_eq!(h(1.5).required_tokens(101), 152);
        // The f64 1.1 is a little above 1.1: ceil(11.000...0009) = 12, as
        // the float product gave before.
        assert_eq!(h(1.1).required_tokens(10), 12);
        assert_eq!(h(2.0).required_tokens((1 << 53) + 1), (1 << 54) + 2);
        assert_eq!(h(1.0).required_tokens(usize::MAX), usize::MAX);
        assert_eq!(h(2.0).required_tokens(usize::MAX), usize::MAX);
        assert_eq!(h(1e300).required_tokens(1), usize::MAX);
        assert_eq!(h(1e300).required_tokens(0), 0);
    }

    fn geom() -> KvGeometry {
        KvGeometry {
            n_layers: 2,
            n_kv_heads: 2,
            head_dim: 4,
            dtype: KvDtype::F32,
        }
    }

    #[test]
    fn decode_needs_one_window_prefill_two() {
        let ok = EngineConfig::decode(geom())
            .max_context(64)
            .pool_tokens(64)
            .build();
        assert!(ok.is_ok());
        let refused = EngineConfig::prefill(geom())
            .max_context(64)
            .pool_tokens(64)
            .build();
        assert!(matches!(
            refused,
            Err(ConfigError::PoolCannotHoldWindow {
                required_tokens: 128,
                ..
            })
        ));
    }

    #[test]
    fn headroom_below_one_is_refused() {
        assert!(Headroom::new(0.99).is_err());
        assert!(Headroom::new(f64::NAN).is_err());
        assert!(Headroom::new(1.0).is_ok());
    }

    #[test]
    fn rounds_to_whole_pages() {
        // 100-token window with 16-token pages needs 7 pages = 112 slots.
        let r = EngineConfig::decode(geom())
            .max_context(100)
            .page_size(16)
            .pool_tokens(111)
            .build();
        assert!(matches!(
            r,
            Err(ConfigError::PoolCannotHoldWindow {
                required_tokens: 112,
                ..
            })
        ));
    }

    #[test]
    fn bad_page_sizes_are_refused() {
        for ps in [0, 3, 24] {
            let r = EngineConfig::decode(geom())
                .max_context(1024)
                .page_size(ps)
                .pool_tokens(4096)
                .build();
            assert!(
                matches!(r, Err(ConfigError::PageSizeNotPowerOfTwo { .. })),
                "{ps}"
            );
        }
    }
}
