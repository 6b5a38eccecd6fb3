//! What the loaded program did with a frame, read from its counters.

use aya::programs::{TestRun, TestRunOptions};
use limiter::kernel::Datapath;
use limiter_common::abi::{GlobalCounters, RuleCounters, counter_slot};
use limiter_tests::snapshot;

use super::reference::{Class, Outcome};

/// The counters one frame can move: the global ones, and each rule's in
/// the slot of frames that arrive on no registered interface (as
/// BPF_PROG_TEST_RUN's do). Read directly: a whole snapshot costs a map
/// lookup per possible rule.
struct Counters {
    global: GlobalCounters,
    rules: Vec<RuleCounters>,
}

/// The rules' ids and names, from one snapshot.
pub(super) fn rule_ids(datapath: &Datapath) -> Vec<(u32, String)> {
    snapshot(datapath)
        .rules
        .into_iter()
        .map(|r| (r.id, r.name))
        .collect()
}

fn counters(datapath: &Datapath, ids: &[(u32, String)]) -> Counters {
    let maps = datapath.maps();
    let mut global = GlobalCounters::default();
    for cpu in maps.global_stats.get(&0, 0).expect("GLOBAL_STATS").iter() {
        global.add(cpu);
    }
    let rules = ids
        .iter()
        .map(|(id, _)| {
            let mut sum = RuleCounters::default();
            for cpu in maps
                .rule_stats
                .get(&counter_slot(0, *id), 0)
                .expect("RULE_STATS")
                .iter()
            {
                sum.add(cpu);
            }
            sum
        })
        .collect();
    Counters { global, rules }
}

/// What the loaded program did with a frame, from its verdict and the
/// counters that moved; `Err` when a frame was counted other than once.
pub(super) fn program(
    datapath: &Datapath,
    ids: &[(u32, String)],
    frame: &[u8],
) -> Result<Outcome, String> {
    let before = counters(datapath, ids);
    let action = datapath
        .program()
        .test_run(TestRunOptions {
            data_in: Some(frame),
            ..TestRunOptions::default()
        })
        .expect("BPF_PROG_TEST_RUN")
        .return_value;
    let after = counters(datapath, ids);
    let (a, b) = (&after.global, &before.global);
    if a.packets - b.packets != 1 {
        return Err(format!("counted {} times", a.packets - b.packets));
    }
    let moved: Vec<&str> = after
        .rules
        .iter()
        .zip(&before.rules)
        .zip(ids)
        .filter(|((x, y), _)| x != y)
        .map(|(_, (_, name))| name.as_str())
        .collect();
    let mut classes = Vec::new();
    if a.non_ip > b.non_ip {
        classes.push(Class::NonIp);
    }
    if a.malformed > b.malformed {
        classes.push(Class::Malformed);
    }
    if a.tiny_fragments > b.tiny_fragments {
        classes.push(Class::Tiny);
    }
    if a.blocked > b.blocked {
        classes.push(Class::Blocked);
    }
    classes.extend(moved.iter().map(|m| Class::Rule((*m).to_owned())));
    let [class] = <[Class; 1]>::try_from(classes.clone())
        .map_err(|_| format!("counted as {classes:?}: not exactly once"))?;
    Ok(Outcome {
        action,
        class,
        ipv4: a.ipv4 - b.ipv4,
        ipv6: a.ipv6 - b.ipv6,
        fragments: a.fragments - b.fragments,
        unreadable: a.unreadable_transport - b.unreadable_transport,
    })
}
