//! Rare events, logged through aya-log into the daemon's logs: a new key
//! the key table had no slot for, a packet whose meter updates lost every
//! retry to other CPUs; and the rare work of the refusal counts, a count
//! a CPU held for a key moved to the key's slot (`drops::move_old`). The
//! decision program hands a packet refused for one of these reasons, or
//! refused while a count waits, to the report program by a tail call, so
//! this code is verified on its own and every other packet pays a
//! comparison of the reason it has anyway (a refused one, a look at its
//! CPU's `PENDING_DROPS` entry too). Each CPU reports each kind at
//! most once a second, with how many it left out since, as a flood can
//! make either happen at every packet.

use aya_ebpf::{macros::xdp, programs::XdpContext};
use aya_log_ebpf::warn;
use limiter_common::trace::reason;

use crate::{
    clock, drops, handoff,
    maps::{CONFIG, REPORT_PROG, REPORT_SCRATCH, REPORT_STATE},
    parse::Source,
    trace::{self, Decision},
};

/// The kinds reported, by `trace::reason`: their index in `ReportState`.
#[inline(always)]
fn kind(reason: u8) -> Option<usize> {
    match reason {
        // A new key found its bucket of the key table full.
        reason::NO_SLOT => Some(0),
        // Every compare-and-swap of a meter (or every try of a window
        // lock) lost to another CPU: the packet was treated as excess.
        reason::CONTENDED => Some(1),
        _ => None,
    }
}

/// How many kinds there are.
const KINDS: usize = 2;

/// Nanoseconds between two reports of one kind on one CPU.
const INTERVAL_NS: u64 = 1_000_000_000;

/// Per CPU: when each kind was last reported, and how often it happened
/// since.
#[repr(C)]
pub struct ReportState {
    last_ns: [u64; KINDS],
    left_out: [u64; KINDS],
}

/// Ends the decision program: through the report program when the packet
/// met a rare event, else as `trace::finish` does.
#[inline(always)]
pub fn finish(ctx: &XdpContext, decision: &Decision) -> u32 {
    let refused = decision.reason() != reason::NONE;
    if (kind(decision.reason()).is_some() || refused && drops::old_waiting())
        && let Some(scratch) = REPORT_SCRATCH.get_ptr_mut(0)
    {
        // SAFETY: this CPU's `REPORT_SCRATCH` value, which only this CPU's
        // running program touches (XDP runs to the end on its CPU, tail calls
        // included); the tail call hands this XDP program's own context to an
        // XDP program (`limiter_report`) and returns only if it failed.
        unsafe {
            *scratch = decision.packed();
            REPORT_PROG.tail_call(ctx, 0);
        }
    }
    trace::finish(ctx, decision)
}

/// The report program: logs the event the decision program handed over
/// (at most once a second per kind on this CPU), then ends the packet
/// with the decision it carries.
#[xdp]
pub fn limiter_report(ctx: XdpContext) -> u32 {
    let Some(packed) = REPORT_SCRATCH.get(0).copied() else {
        return aya_ebpf::bindings::xdp_action::XDP_PASS;
    };
    let decision = Decision::unpacked(packed);
    if let Some(config) = CONFIG.get(0) {
        drops::move_old(config);
    }
    if let Some(kind) = kind(decision.reason()).filter(|&k| k < KINDS)
        && let Some(state) = REPORT_STATE.get_ptr_mut(0)
    {
        let now = clock::now();
        // SAFETY: this CPU's `REPORT_STATE` value, which only this CPU's
        // running program touches; `kind` is below the arrays' length.
        let (last, left_out) =
            unsafe { (&mut (*state).last_ns[kind], &mut (*state).left_out[kind]) };
        if *last == 0 || now.wrapping_sub(*last) >= INTERVAL_NS {
            log(&ctx, decision.reason(), *left_out);
            *last = now.max(1);
            *left_out = 0;
        } else {
            *left_out += 1;
        }
    }
    trace::finish(&ctx, &decision)
}

/// One line per event, naming the packet's rule and source.
#[inline(always)]
fn log(ctx: &XdpContext, why: u8, left_out: u64) {
    let Some(handed) = handoff::received() else {
        return;
    };
    let rule = handed.rule;
    match (why, handoff::source(handed)) {
        (reason::NO_SLOT, Source::V4(addr)) => warn!(
            ctx,
            "key table full: no slot for a new key of rule {} (source {:i}); {} more on this CPU since the last report",
            rule,
            addr,
            left_out
        ),
        (reason::NO_SLOT, Source::V6(addr)) => warn!(
            ctx,
            "key table full: no slot for a new key of rule {} (source {:i}); {} more on this CPU since the last report",
            rule,
            addr,
            left_out
        ),
        _ => warn!(
            ctx,
            "contended: a packet of rule {} lost every update of its meters to other CPUs and was treated as excess; {} more on this CPU since the last report",
            rule,
            left_out
        ),
    }
}
