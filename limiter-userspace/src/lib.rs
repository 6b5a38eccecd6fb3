//! The limiter's userspace. Data flows one way: the rule file ([`rules`])
//! is compiled into the kernel's tables ([`compile`]), written into the
//! loaded program's maps ([`kernel`]) by the [`engine`]; [`render`] turns
//! what it reports into text and metrics; the [`daemon`] (through
//! [`control`]) and `limiter run` ([`session`]) drive it all. Each module
//! imports only from floors below its own, as `docs/architecture.md` draws
//! them (a test holds it: `layering`). Layer 7
//! ([`http`]) applies the same rules with `limiter-common`'s algorithms and
//! uses no kernel module. [`lab`] is the demo's and the tests' network
//! (feature `lab`, on by default: an embedder leaves it out).

pub mod clock;
pub mod compile;
pub mod control;
pub mod daemon;
pub mod engine;
pub mod faults;
pub mod fleet;
pub mod http;
pub mod import;
pub mod kernel;
#[cfg(feature = "lab")]
pub mod lab;
#[cfg(test)]
mod layering;
pub mod listen;
pub mod render;
pub mod rules;
pub mod session;
pub mod trace;
pub mod units;
pub mod wire;
pub mod yaml;
