//! The conformance corpus: arrival traces for every algorithm
//! ([`traces`]) and a reference model written apart from `limiter-common`
//! ([`reference`]). `tests/model.rs` holds `limiter-common`'s functions,
//! `governor` and envoy's formula to it; `limiter-tests` replays the same
//! traces through the XDP program and over HTTP.

pub mod reference;
pub mod traces;
