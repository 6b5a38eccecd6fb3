//! The cost profile by stage (`cargo xtask bench -- profile`): built with
//! `LIMITER_PROFILE_STOP=N`, the program returns right after stage N, so
//! the cost of a stage is the difference between two builds measured on
//! the same frame. Every other build has `STOP_AFTER == 0`, and each
//! `stop_after` is a constant false the compiler removes.

use limiter_common::{
    abi::action,
    trace::{reason, verdict as traced},
};

use crate::trace::Decision;

/// The stages, in the order a packet goes through them.
pub const CONFIG_READ: u32 = 1;
pub const PARSED: u32 = 2;
/// The record written and the decision program entered (the tail call).
pub const HANDED_OVER: u32 = 3;
pub const RULE_MATCHED: u32 = 4;
pub const RULE_LOADED: u32 = 5;
pub const KEY_FOUND: u32 = 6;
pub const BLOCK_CHECKED: u32 = 7;
pub const CLOCK_READ: u32 = 8;
pub const METERED: u32 = 9;

const STOP_AFTER: u32 = match option_env!("LIMITER_PROFILE_STOP") {
    Some(stage) => decimal(stage),
    None => 0,
};

const fn decimal(s: &str) -> u32 {
    let bytes = s.as_bytes();
    let mut n = 0;
    let mut i = 0;
    while i < bytes.len() {
        assert!(
            bytes[i].is_ascii_digit(),
            "LIMITER_PROFILE_STOP: not a number"
        );
        n = n * 10 + (bytes[i] - b'0') as u32;
        i += 1;
    }
    n
}

/// Whether this build stops after `stage`.
#[inline(always)]
pub const fn stop_after(stage: u32) -> bool {
    STOP_AFTER == stage
}

/// The verdict of a build that stopped, made to depend on `value` so the
/// work that computed it is not optimised away.
#[inline(always)]
pub fn verdict(value: u64) -> u32 {
    if value == u64::MAX {
        aya_ebpf::bindings::xdp_action::XDP_PASS
    } else {
        aya_ebpf::bindings::xdp_action::XDP_DROP
    }
}

/// One value that depends on both `a` and `b`.
#[inline(always)]
pub fn both(a: u64, b: u64) -> u64 {
    a ^ b
}

/// A decision-program build's outcome when it stops (as [`verdict`]).
/// Here rather than in `decide`: what only the cut builds compile is kept
/// out of the files `cargo xtask mutants --area kernel` mutates.
#[inline(always)]
pub fn decision(value: u64) -> Decision {
    let action = if verdict(value) == aya_ebpf::bindings::xdp_action::XDP_DROP {
        action::DROP
    } else {
        action::PASS
    };
    Decision::new(action, traced::PASSED, reason::NONE)
}
