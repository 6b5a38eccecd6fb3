//! Crash points for the fault tests: with `LIMITER_CRASH_AT=step:n` in its
//! environment, the process kills itself with SIGKILL (what `kill -9`
//! sends: no destructor, no flush) the n-th time it reaches `step`; with
//! `step:n:panic`, the thread panics there instead (a bug's way out). Steps
//! of a rule apply: `reset` (fresh ids' state cleared), `written` (the
//! inactive generation written, not yet in force), `flipped` (in force,
//! the old rules' keys not yet swept), `sweeping` (one of them swept).
//! Without the variable a crash point costs one lookup of a value read
//! once.

use std::sync::{
    OnceLock,
    atomic::{AtomicU32, Ordering},
};

static TARGET: OnceLock<Option<(String, u32, bool)>> = OnceLock::new();
static HITS: AtomicU32 = AtomicU32::new(0);

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
