//! The conformance corpus: arrival traces for every algorithm
//! ([`traces`]) and a reference model written apart from `limiter-common`
//! ([`reference`]; escalation, whose traces also say when the daemon
//! looks, in [`escalation`]). `tests/model.rs` holds `limiter-common`'s
//! functions, `governor` and envoy's formula to it; `limiter-tests`
//! replays the same traces through the XDP program and over HTTP (the
//! escalation traces through the program and the daemon's watch).

pub mod escalation;
pub mod reference;
pub mod traces;

use reference::Trace;

/// Asserts two verdict lists agree, naming the first arrival where they
/// differ and who (`who`) gave the other verdict.
#[track_caller]
pub fn assert_same(trace: &Trace, expected: &[bool], got: &[bool], who: &str) {
    differs(trace, expected, got, who, "admitted");
}

/// Asserts two lists of which arrivals went over the soft limit agree
/// (`reference::over_soft`), as [`assert_same`] does verdicts.
#[track_caller]
pub fn assert_same_over_soft(trace: &Trace, expected: &[bool], got: &[bool], who: &str) {
    differs(trace, expected, got, who, "over the soft limit");
}

#[track_caller]
fn differs(trace: &Trace, expected: &[bool], got: &[bool], who: &str, what: &str) {
    if let Some(i) = expected.iter().zip(got).position(|(e, g)| e != g) {
        panic!(
            "{who} differs from the reference on {} at arrival {i} ({:?}): {what}: reference {}, got {}",
            trace.name, trace.arrivals[i], expected[i], got[i]
        );
    }
    assert_eq!(
        expected.len(),
        got.len(),
        "{who}: one verdict ({what}) per arrival"
    );
}
