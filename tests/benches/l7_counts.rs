//! The layer-7 decision path against governor keyed, counted rather than
//! timed: instructions and cache misses per check under cachegrind
//! (`cargo bench -p limiter-tests --bench l7_counts`). Timings on a shared
//! VM swing ±20% between runs of one binary; these counts move by a few
//! percent (the maps' hash seeds are random), so they rank two builds
//! where the timings cannot, and they say where the time goes: the
//! second cache level is simulated at this machine's L2 size, so a
//! working set that outgrows it shows as misses per check.
//!
//! Each count is of a run of CHECKS checks, round robin over the keys,
//! less that of a run of none (both first make every key), over CHECKS.

use std::{
    hint::black_box, net::IpAddr, num::NonZeroU32, process::Command, sync::Arc, time::Duration,
};

use anyhow::{Context, Result, bail};
use limiter::http::{Limiter, SystemClock};
use limiter_tests::{machine, request_from, rules};
use serde_json::json;

/// The daemon's allocator (limiter-userspace's main.rs), so a key's state
/// is laid out here as it is there; governor's keys too.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const CHECKS: u64 = 200_000;
const KEY_COUNTS: [u32; 3] = [1_000, 10_000, 100_000];
/// Set in the runs under cachegrind: `limiter` or `governor`.
const CHILD: &str = "L7_COUNTS_CHILD";

fn addr(i: u32) -> IpAddr {
    std::net::Ipv4Addr::from(0x0a00_0000 + i).into()
}

/// The child: makes `keys` keys, then makes `checks` checks.
fn child(which: &str, keys: u32, checks: u64) {
    let round_robin = |check: &mut dyn FnMut(u32) -> bool| {
        for i in 0..keys {
            black_box(check(i));
        }
        for n in 0..checks {
            black_box(check((n % u64::from(keys)) as u32));
        }
    };
    // The l7 benchmark's limits: nothing reaches them, every call admits.
    match which {
        "limiter" => {
            let text = "max_keys: 1000000\nrules:\n  - { name: api, limit: { rate: 1000000000, unit: second, burst: 1000000000 } }\n";
            let ours = Limiter::new(rules(text), Arc::new(SystemClock));
            round_robin(&mut |i| ours.check(&request_from(addr(i))).allowed);
        }
        _ => {
            let quota = governor::Quota::with_period(Duration::from_nanos(1))
                .expect("a period")
                .allow_burst(NonZeroU32::new(1_000_000_000).expect("non-zero"));
            let keyed = governor::RateLimiter::dashmap(quota);
            round_robin(&mut |i| keyed.check_key(&addr(i)).is_ok());
        }
    }
}

/// What cachegrind counted in one run.
#[derive(Clone, Copy, Default)]
struct Counts {
    instructions: f64,
    l1_misses: f64,
    l2_misses: f64,
}

/// The cache cachegrind's last level simulates: this CPU's L2, as sysfs
/// describes it.
#[derive(Clone, Copy)]
struct L2 {
    bytes: u64,
    ways: u64,
    /// Not read from sysfs (a common L2 assumed).
    assumed: bool,
}

fn l2() -> L2 {
    let read = |index: &str, file: &str| {
        std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu0/cache/{index}/{file}"))
            .map(|s| s.trim().to_owned())
            .ok()
    };
    let described = (0..8).map(|i| format!("index{i}")).find_map(|index| {
        if read(&index, "level")? != "2" {
            return None;
        }
        let size = read(&index, "size")?;
        let bytes = match size.strip_suffix('K') {
            Some(k) => k.parse::<u64>().ok()? << 10,
            None => size.parse().ok()?,
        };
        let ways = read(&index, "ways_of_associativity")?.parse().ok()?;
        Some(L2 {
            bytes,
            ways,
            assumed: false,
        })
    });
    // Cachegrind takes only a power of two of sets: a size that does not
    // make one is simulated at the largest that does, below it.
    match described {
        Some(mut l2) if l2.ways > 0 => {
            let sets = (l2.bytes / (l2.ways * 64)).max(1);
            l2.bytes = (1u64 << sets.ilog2()) * l2.ways * 64;
            l2
        }
        _ => L2 {
            bytes: 512 << 10,
            ways: 8,
            assumed: true,
        },
    }
}

fn cachegrind(which: &str, keys: u32, checks: u64, l2: L2) -> Result<Counts> {
    let exe = std::env::current_exe()?;
    let out = Command::new("valgrind")
        .args([
            "--tool=cachegrind",
            "--cache-sim=yes",
            "--cachegrind-out-file=/dev/null",
            "--D1=32768,8,64",
            &format!("--LL={},{},64", l2.bytes, l2.ways),
        ])
        .arg(&exe)
        .env(CHILD, which)
        .env("KEYS", keys.to_string())
        .env("CHECKS", checks.to_string())
        .output()
        .context("running valgrind (cargo xtask setup installs it)")?;
    let text = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        bail!("cachegrind of {which} failed:\n{text}");
    }
    // "==123== I   refs:      583,167,525": the first number after the colon.
    let total = |label: &str| -> Result<f64> {
        text.lines()
            .find_map(|l| l.split_once(label).map(|(_, rest)| rest))
            .and_then(|rest| {
                rest.trim_start_matches([':', ' '])
                    .split_whitespace()
                    .next()
            })
            .and_then(|n| n.replace(',', "").parse().ok())
            .with_context(|| format!("no {label:?} in cachegrind's output:\n{text}"))
    };
    Ok(Counts {
        instructions: total("I   refs")?,
        l1_misses: total("D1  misses")?,
        l2_misses: total("LLd misses")?,
    })
}

/// Per check: the run of `CHECKS` less the run of none, over `CHECKS`.
fn per_check(which: &str, keys: u32, l2: L2) -> Result<Counts> {
    let (with, without) = (
        cachegrind(which, keys, CHECKS, l2)?,
        cachegrind(which, keys, 0, l2)?,
    );
    // Signed: a difference within the runs' noise may come out below 0.
    let per = |a: f64, b: f64| (a - b) / CHECKS as f64;
    Ok(Counts {
        instructions: per(with.instructions, without.instructions),
        l1_misses: per(with.l1_misses, without.l1_misses),
        l2_misses: per(with.l2_misses, without.l2_misses),
    })
}

fn main() -> Result<()> {
    if let Ok(which) = std::env::var(CHILD) {
        let number = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
        let keys = number("KEYS").and_then(|k| u32::try_from(k).ok());
        child(
            &which,
            keys.unwrap_or(10_000),
            number("CHECKS").unwrap_or(0),
        );
        return Ok(());
    }
    let l2 = l2();
    println!(
        "layer-7 decision path against governor keyed, per check under cachegrind ({CHECKS} checks, L1d 32 KiB, L2 {} KiB {}-way {}), mimalloc, {}",
        l2.bytes >> 10,
        l2.ways,
        if l2.assumed {
            "(assumed: sysfs does not describe this CPU's)"
        } else {
            "(this CPU's)"
        },
        machine()
    );
    println!(
        "\n| keys | instructions (limiter / governor) | L1d misses | L2 misses |\n| --- | --- | --- | --- |"
    );
    let mut results = Vec::new();
    for keys in KEY_COUNTS {
        let ours = per_check("limiter", keys, l2)?;
        let theirs = per_check("governor", keys, l2)?;
        println!(
            "| {keys} | {:.0} / {:.0} ({:.2}x) | {:.2} / {:.2} | {:.2} / {:.2} |",
            ours.instructions,
            theirs.instructions,
            ours.instructions / theirs.instructions,
            ours.l1_misses,
            theirs.l1_misses,
            ours.l2_misses,
            theirs.l2_misses,
        );
        let counts = |c: Counts| {
            json!({
                "instructions": c.instructions,
                "l1d_misses": c.l1_misses,
                "l2_misses": c.l2_misses,
            })
        };
        results.push(json!({"keys": keys, "limiter": counts(ours), "governor": counts(theirs)}));
    }
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
    std::fs::create_dir_all(&out)?;
    std::fs::write(
        out.join("l7_counts.json"),
        serde_json::to_string_pretty(&json!({
            "machine": machine(),
            "checks": CHECKS,
            "l2_bytes": l2.bytes,
            "l2_ways": l2.ways,
            "l2_assumed": l2.assumed,
            "results": results,
        }))?,
    )?;
    Ok(())
}
