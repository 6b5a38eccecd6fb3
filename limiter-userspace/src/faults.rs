//! Crash points for the fault tests: with `LIMITER_CRASH_AT=step:n` in its
//! environment, the process kills itself with SIGKILL (what `kill -9`
//! sends: no destructor, no flush) the n-th time it reaches `step`. Steps
//! of a rule apply: `reset` (fresh ids' state cleared), `written` (the
//! inactive generation written, not yet in force), `flipped` (in force,
//! the old rules' keys not yet swept), `sweeping` (one of them swept).
//! Without the variable a crash point costs one lookup of a value read
//! once.

use std::sync::{
    OnceLock,
    atomic::{AtomicU32, Ordering},
};

static TARGET: OnceLock<Option<(String, u32)>> = OnceLock::new();
static HITS: AtomicU32 = AtomicU32::new(0);

pub fn crash_point(step: &str) {
    let target = TARGET.get_or_init(|| {
        let value = std::env::var("LIMITER_CRASH_AT").ok()?;
        let (name, nth) = value.split_once(':').unwrap_or((&value, "1"));
        Some((name.to_owned(), nth.parse().ok()?))
    });
    let Some((name, nth)) = target else {
        return;
    };
    if name == step && HITS.fetch_add(1, Ordering::SeqCst) + 1 == *nth {
        eprintln!("crash point {step}: SIGKILL");
        // SAFETY: signalling ourselves.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
}
