//! `sliding_log`: the exact sliding window. A key remembers every admitted
//! request of the last `U`; a request of cost `c` at `now` is admitted if
//! the costs admitted in `(now − U, now]` plus `c` stay within `R`.
//!
//! It needs a log per key, which the kernel cannot keep: layer 7 only
//! (feature `user`). A request from before the newest admitted one (the
//! clock went backwards) is judged at the newest admitted time, so the
//! log never needs what it has already pruned.

extern crate alloc;

use alloc::collections::VecDeque;

use crate::window::Window;

/// A key's log: (time, cost) of admitted requests, oldest first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Log {
    entries: VecDeque<(u64, u64)>,
    /// Sum of the costs in `entries`.
    total: u64,
}

impl Log {
    /// Admits `cost` at `now` under `R` per `U` (`window`), recording it;
    /// `false` (and nothing recorded) when it does not fit.
    pub fn admit(&mut self, window: &Window, now: u64, cost: u64) -> bool {
        let newest = self.entries.back().map_or(0, |e| e.0);
        let now = now.max(newest);
        let horizon = now.saturating_sub(window.length_ns);
        while let Some(&(t, c)) = self.entries.front() {
            // Entries at or before now − U have left the window (when now
            // is within U of zero nothing has).
            if now < window.length_ns || t > horizon {
                break;
            }
            self.total -= c;
            self.entries.pop_front();
        }
        if cost > window.limit || self.total > window.limit - cost {
            return false;
        }
        if cost > 0 {
            self.entries.push_back((now, cost));
            self.total += cost;
        }
        true
    }

    /// Cost admitted in the window as of the last request.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The oldest entry's time: when the window frees its first unit.
    pub fn oldest(&self) -> Option<u64> {
        self.entries.front().map(|e| e.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;

    #[test]
    fn exact_window() {
        let w = Window::new(3, 10 * SEC).unwrap();
        let mut log = Log::default();
        let t = 100 * SEC;
        assert!(log.admit(&w, t, 1));
        assert!(log.admit(&w, t + 4 * SEC, 2));
        assert!(!log.admit(&w, t + 9 * SEC, 1));
        // At t + 10 s the first request leaves the window: one unit frees.
        assert!(log.admit(&w, t + 10 * SEC, 1));
        assert!(!log.admit(&w, t + 10 * SEC, 1));
        assert_eq!(log.total(), 3);
    }

    /// Guards the window's edge: an entry at exactly `now − U` has left
    /// the window `(now − U, now]`, also when `now − U` is 0.
    #[test]
    fn an_entry_leaves_at_exactly_one_window() {
        let w = Window::new(1, 10 * SEC).unwrap();
        let mut log = Log::default();
        assert!(log.admit(&w, 0, 1));
        assert!(!log.admit(&w, 10 * SEC - 1, 1));
        assert!(log.admit(&w, 10 * SEC, 1));
    }

    /// Guards the cost bounds: a request costing exactly the limit fits an
    /// empty window, and a free request is admitted but never logged (it
    /// would otherwise become the oldest entry a `Reset` is computed from).
    #[test]
    fn costs_at_the_limit_and_free_requests() {
        let w = Window::new(5, SEC).unwrap();
        let mut log = Log::default();
        assert!(log.admit(&w, 3 * SEC, 0));
        assert_eq!(log.oldest(), None);
        assert!(log.admit(&w, 4 * SEC, 5));
        assert_eq!((log.total(), log.oldest()), (5, Some(4 * SEC)));
        assert!(!log.admit(&w, 4 * SEC, 1));
        assert!(log.admit(&w, 4 * SEC, 0));
    }
}
