//! The XDP rate limiter, in two programs joined by a tail call so the
//! verifier checks each alone: `limiter` (`entry`) parses the frame,
//! counts it and matches its rule; `limiter_decide` (`decide`) applies
//! blocks and the rule's meters, counts, and decides. `limiter_trace`
//! (`trace`) reports decisions while someone traces.
#![no_std]
#![no_main]
#![feature(core_intrinsics)]
#![expect(
    internal_features,
    reason = "atomic_cxchg is the only CAS the BPF target offers"
)]

mod admission;
mod blocks;
mod cell;
mod clock;
mod decide;
mod drops;
mod entry;
mod fragments;
mod handoff;
mod keys;
mod maps;
mod matching;
mod meter;
mod parse;
mod profile;
mod report;
mod runtime;
mod trace;

use aya_ebpf::{macros::xdp, programs::XdpContext};

/// The program attached to interfaces.
#[xdp]
pub fn limiter(ctx: XdpContext) -> u32 {
    entry::run(&ctx)
}

/// The decision, tail called by `limiter` (`STAGES`).
#[xdp]
pub fn limiter_decide(ctx: XdpContext) -> u32 {
    decide::run(&ctx)
}
