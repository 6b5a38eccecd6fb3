//! Escalation: a key that stays over its hard limit for longer than a
//! rule's `after` is blocked for the rule's `block` time. The same watch
//! in both layers: the daemon looks at every kernel key once a second,
//! layer 7 at a key each time it judges one of its requests.

use crate::{
    abi::{KeyState, RuleConfig, algorithm, rule_flag},
    gcra::{Check, Gcra},
    keytable::window_state,
};

/// A rule's `escalate: { after, block }`, in ns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Escalation {
    pub after_ns: u64,
    pub block_ns: u64,
}

impl Escalation {
    /// A key looked at at `now`, over its limit or not, watched since
    /// `over_since` (0: it was not over at the last look): the watch to
    /// keep, and whether to block the key now. A look at which it is not
    /// over ends the watch; so does a block.
    pub fn observe(&self, over_since: u64, over: bool, now: u64) -> (u64, bool) {
        if !over {
            return (0, false);
        }
        let since = if over_since == 0 {
            now.max(1)
        } else {
            over_since
        };
        if now.saturating_sub(since) >= self.after_ns {
            (0, true)
        } else {
            (since, false)
        }
    }
}

/// Whether a kernel key, kept under `rule`, is over its limit at `now`:
/// its next packet (of one byte, for a byte meter) would be refused.
/// `third`: the rule's third limit, if it has one (`rule_flag::THIRD_LIMIT`;
/// its meter is in another map). `realtime_offset_ns` as the kernel's
/// windows take it.
pub fn over_limit(
    state: &KeyState,
    rule: &RuleConfig,
    third: Option<&Gcra>,
    now: u64,
    realtime_offset_ns: u64,
) -> bool {
    let third_over = third.is_some_and(|g| {
        rule.flags & rule_flag::THIRD_LIMIT != 0 && g.check(state.meters[2], now, 1) == Check::Deny
    });
    let meters = [
        (rule_flag::LIMIT_PACKETS, &rule.packets, 0),
        (rule_flag::LIMIT_BYTES, &rule.bytes, 1),
    ];
    third_over
        || meters.iter().any(|(flag, meter, i)| {
            if rule.flags & flag == 0 {
                return false;
            }
            if rule.algorithm == algorithm::GCRA {
                return meter.gcra.check(state.meters[*i], now, 1) == Check::Deny;
            }
            let sliding = rule.algorithm == algorithm::SLIDING_WINDOW;
            let window = window_state(state, i + 1);
            meter
                .window
                .check(&window, now.wrapping_add(realtime_offset_ns), 1, sliding)
                .is_none()
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_over_its_limit_at_every_look_is_blocked_after_the_wait() {
        let e = Escalation {
            after_ns: 10,
            block_ns: 100,
        };
        assert_eq!(e.observe(0, true, 5), (5, false));
        assert_eq!(e.observe(5, true, 14), (5, false));
        assert_eq!(e.observe(5, true, 15), (0, true));
        // One look within its limit starts the wait over.
        assert_eq!(e.observe(5, false, 12), (0, false));
        assert_eq!(e.observe(0, true, 13), (13, false));
        // Time zero is a time too.
        assert_eq!(e.observe(0, true, 0), (1, false));
    }

    #[test]
    fn over_limit_is_the_next_packet_refused() {
        let mut rule = RuleConfig {
            flags: rule_flag::LIMIT_PACKETS,
            ..RuleConfig::default()
        };
        rule.packets.gcra = Gcra::new(10, 1_000_000_000, 2).unwrap();
        let now = 1_000_000_000;
        let at = |tat| KeyState {
            meters: [tat, 0, 0],
            ..KeyState::default()
        };
        assert!(!over_limit(&at(now), &rule, None, now, 0), "a whole bucket");
        // One packet in: one more fits.
        assert!(!over_limit(&at(now + 100_000_000), &rule, None, now, 0));
        // The burst spent: the next is refused.
        assert!(over_limit(&at(now + 200_000_000), &rule, None, now, 0));
        // A third limit (2 a minute) spent: over, though the first has room.
        let minute = Gcra::new(2, 60_000_000_000, 2).unwrap();
        rule.flags |= rule_flag::THIRD_LIMIT;
        let spent = KeyState {
            meters: [now, 0, now + 60_000_000_000],
            ..KeyState::default()
        };
        assert!(over_limit(&spent, &rule, Some(&minute), now, 0));
        assert!(!over_limit(&at(now), &rule, Some(&minute), now, 0));
        // The rule's flags say whether its third word is a limit (a soft
        // limit's meter is kept there too): without the flag it is not one.
        rule.flags &= !rule_flag::THIRD_LIMIT;
        assert!(!over_limit(&spent, &rule, Some(&minute), now, 0));
    }

    #[test]
    fn over_limit_reads_each_window_meter_by_its_algorithm() {
        use crate::{keytable::pack_counts, window::WindowState};
        let second = 1_000_000_000;
        let start = 1_700_000_000 * second;
        let ten = crate::window::Window::new(10, second).unwrap();
        let mut rule = RuleConfig {
            flags: rule_flag::LIMIT_PACKETS,
            algorithm: algorithm::FIXED_WINDOW,
            ..RuleConfig::default()
        };
        rule.packets.window = ten;
        // A whole last window and 4 in this one, a tenth of it gone: the
        // fixed window has room for 6, the sliding one weighs the last
        // window at 9 of 10 and is over.
        let counts = |previous, current| {
            pack_counts(&WindowState {
                start,
                previous,
                current,
            })
        };
        let state = KeyState {
            meters: [start, counts(10, 4), 0],
            ..KeyState::default()
        };
        let now = start + second / 10;
        assert!(!over_limit(&state, &rule, None, now, 0), "fixed");
        rule.algorithm = algorithm::SLIDING_WINDOW;
        assert!(over_limit(&state, &rule, None, now, 0), "sliding");
        // The clock the windows take is the realtime one: the same state a
        // second later (by the offset) is in the next window.
        assert!(
            !over_limit(&state, &rule, None, start, second),
            "sliding, next window"
        );
        // The byte meter is the key's third word, the packet meter its second.
        rule.algorithm = algorithm::FIXED_WINDOW;
        rule.flags = rule_flag::LIMIT_BYTES;
        rule.bytes.window = ten;
        let bytes_spent = KeyState {
            meters: [start, 0, counts(0, 10)],
            ..KeyState::default()
        };
        assert!(over_limit(&bytes_spent, &rule, None, now, 0), "bytes spent");
        assert!(!over_limit(&state, &rule, None, now, 0), "bytes untouched");
    }
}
