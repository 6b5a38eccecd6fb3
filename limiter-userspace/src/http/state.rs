//! A key's state (or a rule's aggregate's): its meters' cells, when it was
//! last seen, what only some rules' keys keep, and a request counted in
//! flight against it.

use std::sync::{
    Arc, Mutex,
    atomic::{AtomicU64, Ordering},
};

use limiter_common::{log::Log, window::WindowState};
use once_cell::race::OnceBox;

/// State of one key (or of a rule's aggregate): GCRA cells for the
/// request meter (0) and the byte meter (1), and the cell of the soft
/// request meter (2, as the kernel keeps it in a key's third word), then
/// last-seen and the escalation block: what every request reads. With
/// the `Arc`'s counts it is 64 bytes, one cache line under mimalloc (the
/// daemon's allocator, whose 64-byte blocks are 64-byte aligned): at
/// 10,000 keys, a larger state, or one over two lines, is more misses per
/// request. What only some rules' keys use is apart ([`Cold`]), made at
/// its first use.
#[derive(Default)]
#[repr(C)]
pub(super) struct State {
    pub(super) cells: [AtomicU64; 3],
    /// When the key was last seen (monotonic ns), for eviction, stored at
    /// most once a [`SEEN_GRANULE_NS`].
    pub(super) last_seen: AtomicU64,
    /// Escalation (`escalate`): until when the key is blocked (monotonic
    /// ns; 0: not blocked).
    pub(super) blocked_until: AtomicU64,
    pub(super) cold: OnceBox<Cold>,
}

/// What a key of some rules keeps besides its meters: escalation's watch,
/// the requests in flight, the window and log algorithms' counts. A key
/// of a plain GCRA rule never makes it.
#[derive(Default)]
pub(super) struct Cold {
    /// Escalation: since when the key has been over its limit at every
    /// request (0: it was not at the last), and when one of its requests
    /// was last refused (monotonic ns).
    pub(super) over_since: AtomicU64,
    pub(super) last_refused: AtomicU64,
    /// Requests in flight (rules with `concurrent`).
    in_flight: AtomicU64,
    /// Made only for the window and log algorithms' keys (a hundred and
    /// more bytes an escalated or counted-in-flight GCRA key does not
    /// need).
    counts: OnceBox<Counts>,
}

#[derive(Default)]
struct Counts {
    windows: Mutex<[WindowState; 2]>,
    logs: Mutex<[Log; 2]>,
}

/// How far `State::last_seen` may lag: the requests of one key do not all
/// write its cache line. (For a key whose state says when it rests, a
/// request's store may land after a later one's: see [`State::seen`].)
const SEEN_GRANULE_NS: u64 = 1_000_000;

impl State {
    pub(super) fn cold(&self) -> &Cold {
        self.cold.get_or_init(Box::default)
    }

    fn counts(&self) -> &Counts {
        self.cold().counts.get_or_init(Box::default)
    }

    pub(super) fn windows(&self) -> &Mutex<[WindowState; 2]> {
        &self.counts().windows
    }

    pub(super) fn logs(&self) -> &Mutex<[Log; 2]> {
        &self.counts().logs
    }

    /// Seen at `now` (monotonic ns; 0: not judged, nothing to note).
    /// `rests_by_state`: the key's state says itself when it rests (a
    /// metered GCRA rule's, [`super::classify::rest_ns`] `None`), and when
    /// it was seen only ranks it for eviction among keys at rest: a plain
    /// store does, though a request judged earlier may store last (at
    /// 10,000 keys, a locked max here was a tenth of a check). Other keys
    /// (windows, logs, unlimited rules) rest a span after they were last
    /// seen, so that never goes back.
    pub(super) fn seen(&self, now: u64, rests_by_state: bool) {
        seen(&self.last_seen, now, rests_by_state);
    }

    pub(super) fn last_seen(&self) -> u64 {
        last_seen(&self.last_seen)
    }
}

/// Notes in a key's last-seen `cell` that it was seen at `now` (see
/// [`State::seen`]).
#[inline]
pub(super) fn seen(cell: &AtomicU64, now: u64, rests_by_state: bool) {
    if cell.load(Ordering::Relaxed).saturating_add(SEEN_GRANULE_NS) <= now {
        if rests_by_state {
            cell.store(now, Ordering::Relaxed);
        } else {
            cell.fetch_max(now, Ordering::Relaxed);
        }
    }
}

/// No earlier than when a key was last seen, by its last-seen `cell` (for
/// a key whose state says when it rests, about then: see [`State::seen`]).
pub(super) fn last_seen(cell: &AtomicU64) -> u64 {
    cell.load(Ordering::Relaxed).saturating_add(SEEN_GRANULE_NS)
}

/// One request counted against its key's `concurrent` limit, until this
/// is dropped.
pub struct InFlight(Arc<State>);

impl InFlight {
    /// Counts a request in flight, unless `max` already are.
    pub(super) fn enter(state: &Arc<State>, max: u32) -> Option<Self> {
        let in_flight = &state.cold().in_flight;
        let before = in_flight.fetch_add(1, Ordering::AcqRel);
        if before >= u64::from(max) {
            in_flight.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(Self(Arc::clone(state)))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.cold().in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

impl PartialEq for InFlight {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for InFlight {}

impl std::fmt::Debug for InFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.cold().in_flight.load(Ordering::Relaxed);
        write!(f, "InFlight({n} of this key)")
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::{Cold, State};

    /// A key of a GCRA rule (most keys) costs its state's words and a
    /// pointer to what only some rules use: with the `Arc`'s two counts,
    /// one cache line. What escalation and in-flight counting add is 32
    /// bytes; the window and log counts, only their algorithms' keys make.
    #[test]
    fn a_key_state_and_its_counts_fill_one_cache_line() {
        assert_eq!(std::mem::size_of::<State>(), 6 * 8);
        let layout = std::alloc::Layout::for_value(&*Arc::new(State::default()));
        assert_eq!(layout.size() + 2 * std::mem::size_of::<usize>(), 64);
        assert_eq!(std::mem::size_of::<Cold>(), 4 * 8);
    }
}
