//! Crash points for the fault tests: with `LIMITER_CRASH_AT=step:n` in its
//! environment, the process kills itself with SIGKILL (what `kill -9`
//! sends: no destructor, no flush) the n-th time it reaches `step`; with
//! `step:n:panic`, the thread panics there instead (a bug's way out). Steps
//! of a rule apply: `reset` (fresh ids' state cleared), `written` (the
//! inactive generation written, not yet in force), `flipped` (in force,
//! the old rules' keys not yet swept), `sweeping` (one of them swept).
//! Without the variable a crash point costs one lookup of a value read
//! once.
//!
//! Only in builds with the `faults` feature (`cargo xtask test` builds
//! the binary it tests so): elsewhere, a release build above all, a crash
//! point is nothing, and no variable in a process's environment can kill
//! it.

#[cfg(feature = "faults")]
use std::sync::{
    OnceLock,
    atomic::{AtomicU32, Ordering},
};

#[cfg(feature = "faults")]
static TARGET: OnceLock<Option<(String, u32, bool)>> = OnceLock::new();
#[cfg(feature = "faults")]
static HITS: AtomicU32 = AtomicU32::new(0);

/// A build without the `faults` feature has no crash point.
#[cfg(not(feature = "faults"))]
#[inline(always)]
pub fn crash_point(_step: &str) {}

#[cfg(feature = "faults")]
pub fn crash_point(step: &str) {
    let target = TARGET.get_or_init(|| {
        let value = std::env::var("LIMITER_CRASH_AT").ok()?;
        let mut parts = value.split(':');
        let name = parts.next()?.to_owned();
        let nth = parts.next().unwrap_or("1").parse().ok()?;
        Some((name, nth, parts.next() == Some("panic")))
    });
    let Some((name, nth, panic)) = target else {
        return;
    };
    if name == step && HITS.fetch_add(1, Ordering::SeqCst) + 1 == *nth {
        if *panic {
            panic!("crash point {step}: panic");
        }
        eprintln!("crash point {step}: SIGKILL");
        // SAFETY: signalling ourselves.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
}

#[cfg(test)]
mod tests {
    use std::{os::unix::process::ExitStatusExt, process::Command};

    use super::crash_point;

    /// This test's name, for the copy of the test binary it runs.
    const SELF: &str = "faults::tests::a_crash_point_kills_only_a_build_with_the_feature";

    #[test]
    fn a_crash_point_kills_only_a_build_with_the_feature() {
        if std::env::var_os("LIMITER_CRASH_AT").is_some() {
            // The child: reach the point its variable names.
            crash_point("probe");
            return;
        }
        let status = Command::new(std::env::current_exe().expect("the test binary"))
            .args(["--exact", SELF, "--test-threads=1", "--quiet"])
            .env("LIMITER_CRASH_AT", "probe:1")
            .output()
            .expect("running the test binary again")
            .status;
        if cfg!(feature = "faults") {
            assert_eq!(status.signal(), Some(libc::SIGKILL), "{status}");
        } else {
            assert!(
                status.success(),
                "a build without `faults` crashed: {status}"
            );
        }
    }
}
