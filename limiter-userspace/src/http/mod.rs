//! Layer 7: the same rule file and the same `limiter-common` functions as
//! the kernel, applied to requests. A rule matches a request by its client
//! address (TCP, the service's port), keys it by the same masked address as
//! the kernel (or by a header, or any key the caller extracts), and meters
//! it with the same GCRA or window code: one request costs 1 against
//! packet (`rate`) limits, and its size against byte (`bytes`) limits.
//!
//! Each of its jobs is a file of its own (`limiter`, the way to a
//! decision; `decide`, `meter`, `quota`; a key's `state` and `identity`;
//! ...), importing its siblings directly; this file only declares them
//! and re-exports what callers use.

mod body;
mod classify;
pub mod client;
mod clock;
mod counters;
mod decide;
mod decision;
mod escalation;
mod fleet;
mod fleet_meter;
pub mod forwarded;
pub mod headers;
mod identity;
mod keying;
mod keys;
pub mod layer;
mod limiter;
mod meter;
pub mod proxy;
mod quota;
mod reload;
mod state;
pub mod striped;
#[cfg(test)]
mod tests;
pub mod trace;

pub use body::BodyMeter;
pub use clock::{Clock, SystemClock};
pub use counters::HttpCounters;
pub use decision::{Decision, Quota, RequestMeta};
pub use layer::{BodyCharge, ClientAddr, CostBy, KeyBy, RateLimit, RateLimitLayer};
pub use limiter::Limiter;
pub use reload::Reloadable;
pub use state::InFlight;
#[cfg(test)]
pub(crate) use tests::test_headers;
