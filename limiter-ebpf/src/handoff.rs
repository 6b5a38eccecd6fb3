//! From the entry program to the decision program: the packet as parsed
//! (`abi::Handoff`) in a per-CPU map, then a tail call. The decision
//! program starts from nothing but that record, so the verifier checks
//! it once, however many ways there were to parse the frame.

use aya_ebpf::programs::XdpContext;
use limiter_common::abi::{Handoff, handoff_flag};

use crate::{
    maps::{HANDOFF, STAGES},
    parse::Source,
};

/// `STAGES` index of the decision program.
const DECIDE: u32 = 0;

/// This CPU's record. XDP runs to the end on its CPU, tail calls
/// included, so no other packet uses it meanwhile.
#[inline(always)]
pub fn slot() -> Option<*mut Handoff> {
    HANDOFF.get_ptr_mut(0)
}

/// Hands the packet (written in [`slot`]) over; returns only if the
/// decision program is not there (a loader that did not fill `STAGES`).
#[inline(always)]
pub fn hand_over(ctx: &XdpContext) {
    // SAFETY: a tail call to a program of the same type, with its context.
    unsafe { STAGES.tail_call(ctx, DECIDE) };
}

/// The packet the entry program handed over.
#[inline(always)]
pub fn received() -> Option<&'static mut Handoff> {
    // SAFETY: see `slot`: only this CPU's running program touches it.
    slot().map(|slot| unsafe { &mut *slot })
}

/// The source as the entry program read it.
#[inline(always)]
pub fn source(handed: &Handoff) -> Source {
    if handed.flags & handoff_flag::V6 != 0 {
        Source::V6(handed.addr)
    } else {
        let a = handed.addr;
        Source::V4([a[0], a[1], a[2], a[3]])
    }
}
