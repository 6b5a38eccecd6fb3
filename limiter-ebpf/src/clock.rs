//! The clock every TAT is kept in.

/// Nanoseconds of CLOCK_MONOTONIC, the clock every TAT is kept in.
#[cfg(not(feature = "test-clock"))]
#[inline(always)]
pub fn now() -> u64 {
    // SAFETY: bpf_ktime_get_ns takes no arguments and touches no memory;
    // every program type may call it.
    unsafe { aya_ebpf::helpers::bpf_ktime_get_ns() }
}

/// Test builds: the time the test stored in the CLOCK map, so traces
/// replay with exact arrival times through BPF_PROG_TEST_RUN.
#[cfg(feature = "test-clock")]
#[inline(always)]
pub fn now() -> u64 {
    crate::maps::CLOCK.get(0).copied().unwrap_or(0)
}
