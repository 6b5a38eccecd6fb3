//! Rule files applied: re-read from disk (SIGHUP, `watch`) or sent over
//! the control socket, validated first, so an invalid file changes nothing.

use std::{
    path::Path,
    sync::{Arc, atomic::Ordering},
};

use anyhow::Result;

use super::{fleet::sync_fleet, shared::Shared};
use crate::{rules::RuleSet, wire::Change};

pub async fn reload_file(shared: &Arc<Shared>) {
    let path = shared.config.rules.clone();
    let origin = path.display().to_string();
    let rejected = match tokio::fs::read_to_string(&path).await {
        Ok(text) => apply(shared, text, origin).await.err(),
        Err(e) => Some(anyhow::Error::new(e).context(format!("{}: cannot read", path.display()))),
    };
    if let Some(e) = rejected {
        shared.rule_file_rejections.fetch_add(1, Ordering::Relaxed);
        tracing::error!(event = "rules_rejected", origin = %path.display(), error = %format!("{e:#}"), "{e:#}; nothing changed");
    }
}

/// Validates and applies rule-file text; an invalid file changes nothing.
pub async fn apply(shared: &Arc<Shared>, text: String, origin: String) -> Result<Change> {
    let shared = Arc::clone(shared);
    tokio::task::spawn_blocking(move || {
        let rules = RuleSet::parse(&text, Path::new(&origin))?;
        let (change, fleet_rules) = {
            let mut engine = shared.engine();
            (engine.apply(rules)?, engine.fleet_rules())
        };
        shared.generation.fetch_add(1, Ordering::Relaxed);
        change.log(&origin);
        sync_fleet(&shared, &fleet_rules);
        Ok(change)
    })
    .await?
}
