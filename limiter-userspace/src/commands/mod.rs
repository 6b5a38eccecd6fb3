pub mod lab;
pub mod run;

use std::path::Path;

use anyhow::Result;
use limiter::{config::RuleSet, report, stats::CounterMaps};

pub fn stats(pin_dir: &Path, json: bool) -> Result<()> {
    limiter::limiter::require_root()?;
    let snapshot = CounterMaps::from_pins(pin_dir)?.read()?;
    if json {
        println!("{}", serde_json::to_string_pretty(&snapshot)?);
    } else {
        print!("{}", report::stats_table(&snapshot));
    }
    Ok(())
}

pub fn check(path: &Path, json: bool) -> Result<()> {
    let set = RuleSet::load(path)?;
    if json {
        let rules: Vec<_> = set
            .rules
            .iter()
            .map(|r| {
                serde_json::json!({
                    "name": r.name,
                    "source": r.matches.source.map(|s| s.to_string()),
                    "protocol": r.matches.protocol,
                    "dest_port": r.matches.dest_port,
                    "key": { "ipv4": r.key.v4, "ipv6": r.key.v6 },
                    "shadow": r.shadow,
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({ "file": path, "valid": true, "rules": rules })
        );
    } else {
        println!("{}: valid, {} rules\n", path.display(), set.rules.len());
        print!("{}", report::rules_table(&set));
    }
    Ok(())
}
