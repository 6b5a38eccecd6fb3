//! Which rule of a new rule file takes which old rule's state: one pairing
//! for both layers (the kernel's rule ids, which `engine` hands on; layer
//! 7's states, which `http`'s reload shares), so a file means the same
//! change to both.

use std::collections::HashMap;

use super::Rule;

/// What pairing reads of a rule in force: the kernel keeps these of each
/// of its rules (its `RuleConfig`), layer 7 the rules themselves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OldRule<'a> {
    pub fingerprint: u64,
    /// 0: written by a build that kept no identity, so paired by its
    /// fingerprint alone.
    pub identity: u32,
    /// As the kernel keeps it: bytes.
    pub name: &'a [u8],
}

impl<'a> From<&'a Rule> for OldRule<'a> {
    fn from(rule: &'a Rule) -> Self {
        Self {
            fingerprint: rule.fingerprint(),
            identity: rule.identity(),
            name: rule.name.as_bytes(),
        }
    }
}

/// The old rule (its index among the old rules) whose state a new rule
/// takes, and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Paired {
    /// The same fingerprint: its state as it is.
    Kept(usize),
    /// The same identity, other limits: its keys, their state carried over
    /// to the new limits.
    Carried(usize),
}

impl Paired {
    /// The old rule's index.
    pub fn old(self) -> usize {
        match self {
            Paired::Kept(i) | Paired::Carried(i) => i,
        }
    }
}

/// By new rule, in `new`'s order: the old rule whose state it takes, if
/// any. First by fingerprint: several old rules of one fingerprint (a
/// validated file has none, the second's match could never apply; the
/// kernel may hold what an older build let through) go to the new rules of
/// it in turn, the last old one first. Then, of the old rules left, by
/// identity ([`same_name_first`] of those with the new rule's), each old
/// rule once.
pub fn pair(old: &[OldRule<'_>], new: &[Rule]) -> Vec<Option<Paired>> {
    let mut reusable: HashMap<u64, Vec<usize>> = HashMap::new();
    for (i, rule) in old.iter().enumerate() {
        reusable.entry(rule.fingerprint).or_default().push(i);
    }
    let mut pairs: Vec<Option<Paired>> = new
        .iter()
        .map(|rule| {
            reusable
                .get_mut(&rule.fingerprint())
                .and_then(Vec::pop)
                .map(Paired::Kept)
        })
        .collect();
    // Then a rule whose limits alone changed takes the keys of the old
    // rule with its identity.
    let mut taken = vec![false; old.len()];
    for i in pairs.iter().flatten().map(|p| p.old()) {
        taken[i] = true;
    }
    let mut same_keys: HashMap<u32, Vec<usize>> = HashMap::new();
    for (i, rule) in old.iter().enumerate() {
        if rule.identity != 0 && !taken[i] {
            same_keys.entry(rule.identity).or_default().push(i);
        }
    }
    for (slot, rule) in pairs.iter_mut().zip(new) {
        if slot.is_none()
            && let Some(candidates) = same_keys.get_mut(&rule.identity())
            && let Some(k) = same_name_first(candidates, |&i| old[i].name == rule.name.as_bytes())
        {
            *slot = Some(Paired::Carried(candidates.remove(k)));
        }
    }
    pairs
}

/// Which of `candidates` (old rules with a new rule's identity) carries
/// its keys over: the one of the same name if any (so a file that swaps
/// two rules' limits pairs them by name, in both layers), else the first.
fn same_name_first<T>(candidates: &[T], same_name: impl Fn(&T) -> bool) -> Option<usize> {
    if candidates.is_empty() {
        return None;
    }
    Some(candidates.iter().position(same_name).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::{OldRule, Paired, pair};
    use crate::rules::{Rule, RuleSet};

    /// The rules of a file of `rules` (one a line, in flow style).
    fn rules(rules: &[&str]) -> Vec<Rule> {
        let text = format!("rules:\n  - {}\n", rules.join("\n  - "));
        RuleSet::parse(&text, std::path::Path::new("t.yaml"))
            .expect("rules")
            .rules
    }

    /// `old` as pairing reads it.
    fn held(old: &[Rule]) -> Vec<OldRule<'_>> {
        old.iter().map(OldRule::from).collect()
    }

    const A: &str = "{ name: a, match: { source: 10.0.0.0/8 }, limit: { rate: 10, unit: second } }";
    const B: &str = "{ name: b, match: { source: 10.1.0.0/16 }, limit: { rate: 5, unit: second } }";
    const C: &str = "{ name: c, limit: { rate: 100, unit: minute } }";

    /// A rule whose fingerprint is unchanged keeps its state wherever it
    /// moved in the file, renamed or not; a rule gone leaves its state.
    #[test]
    fn an_unchanged_rule_keeps_its_state_wherever_it_moved() {
        let old = rules(&[A, B, C]);
        let renamed = C.replace("name: c", "name: everyone");
        let new = rules(&[&renamed, A]);
        assert_eq!(
            pair(&held(&old), &new),
            [Some(Paired::Kept(2)), Some(Paired::Kept(0))]
        );
    }

    /// A rule whose limits alone changed carries its keys; one whose
    /// match, key or algorithm changed starts afresh.
    #[test]
    fn a_rule_whose_limits_alone_changed_carries_its_keys() {
        let old = rules(&[A, B]);
        let new = rules(&[
            &A.replace("rate: 10", "rate: 20"),
            &B.replace("10.1.0.0/16", "10.2.0.0/16"),
        ]);
        assert_eq!(pair(&held(&old), &new), [Some(Paired::Carried(0)), None]);
        let windowed = rules(&[&A.replace("limit:", "algorithm: fixed_window, limit:")]);
        assert_eq!(pair(&held(&old), &windowed), [None]);
        let keyed = rules(&[&A.replace("limit:", "key: source/24, limit:")]);
        assert_eq!(pair(&held(&old), &keyed), [None]);
    }

    /// Fingerprints are paired before identities, whatever the order of
    /// the new rules: an old rule kept as it is is no one's to carry.
    #[test]
    fn a_fingerprint_is_paired_before_an_identity() {
        let old = rules(&[A]);
        let mut new = rules(&[&A.replace("rate: 10", "rate: 20")]);
        new.extend(rules(&[&A.replace("name: a", "name: again")]));
        assert_eq!(pair(&held(&old), &new), [None, Some(Paired::Kept(0))]);
    }

    /// Of old rules with a new rule's identity, the one of its name carries
    /// its keys (a file that swapped two rules' limits), else the first;
    /// each old rule once.
    #[test]
    fn the_old_rule_of_the_same_name_carries_its_keys_first() {
        let [api, third] = [A, &A.replace("name: a", "name: third")].map(|r| rules(&[r]));
        let identity = api[0].identity();
        let old = [
            OldRule {
                fingerprint: 1,
                identity,
                name: b"other",
            },
            OldRule {
                fingerprint: 2,
                identity,
                name: b"a",
            },
        ];
        assert_eq!(pair(&old, &api), [Some(Paired::Carried(1))]);
        assert_eq!(pair(&old, &third), [Some(Paired::Carried(0))]);
        let both = [api[0].clone(), api[0].clone(), api[0].clone()];
        assert_eq!(
            pair(&old, &both),
            [Some(Paired::Carried(1)), Some(Paired::Carried(0)), None]
        );
    }

    /// An old rule that kept no identity (an older build's) is paired by
    /// its fingerprint alone.
    #[test]
    fn an_old_rule_without_an_identity_is_paired_by_fingerprint_alone() {
        let new = rules(&[A]);
        let old = |fingerprint| OldRule {
            fingerprint,
            identity: 0,
            name: b"a",
        };
        let fingerprint = new[0].fingerprint();
        assert_eq!(pair(&[old(fingerprint)], &new), [Some(Paired::Kept(0))]);
        assert_eq!(pair(&[old(fingerprint ^ 1)], &new), [None]);
    }

    /// Several old rules of one fingerprint (what the kernel may hold of an
    /// older build's file) go to the new rules of it in turn, the last old
    /// one first; one left over may carry its keys to a rule of its
    /// identity.
    #[test]
    fn old_rules_of_one_fingerprint_go_in_turn_the_last_first() {
        let old = rules(&[A, B]);
        let twice = [held(&old)[0], held(&old)[0]];
        let a = rules(&[A]);
        let two = [a[0].clone(), a[0].clone()];
        assert_eq!(
            pair(&twice, &two),
            [Some(Paired::Kept(1)), Some(Paired::Kept(0))]
        );
        let mut then_carried = a.clone();
        then_carried.extend(rules(&[&A.replace("rate: 10", "rate: 20")]));
        assert_eq!(
            pair(&twice, &then_carried),
            [Some(Paired::Kept(1)), Some(Paired::Carried(0))]
        );
    }

    /// Why a validated file pairs one to one: no two of its rules share a
    /// fingerprint (their match would be one, and the second never apply).
    #[test]
    fn a_validated_file_has_no_two_rules_of_one_fingerprint() {
        let text = format!("rules:\n  - {A}\n  - {}\n", A.replace("name: a", "name: b"));
        let refused = RuleSet::parse(&text, std::path::Path::new("t.yaml"));
        assert!(refused.is_err(), "{refused:?}");
    }
}
