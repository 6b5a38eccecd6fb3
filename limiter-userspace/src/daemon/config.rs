//! The daemon's configuration file: what it reads, its defaults, and the
//! checks made before anything starts.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::{control, fleet::FleetConfig, kernel::pins, listen::Limits, wire::Mode};

/// The daemon's own configuration file.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DaemonConfig {
    /// The rule file (relative paths are relative to this file's folder).
    pub rules: PathBuf,
    pub interfaces: Vec<InterfaceConfig>,
    #[serde(default = "default_pin_dir")]
    pub pin_dir: PathBuf,
    #[serde(default = "default_socket")]
    pub socket: PathBuf,
    /// `host:port` of the Prometheus endpoint, or `off`. Default: loopback only.
    #[serde(default = "default_metrics")]
    pub metrics: String,
    /// Re-apply the rule file when it changes on disk.
    #[serde(default)]
    pub watch: bool,
    /// The metrics endpoint's connection cap and header deadline.
    #[serde(default)]
    pub metrics_listener: Limits,
    /// The control socket's connection cap, and how long a client may take
    /// to send a whole request (each connection may buffer a 4 MiB rule
    /// file, hence a lower cap).
    #[serde(default = "default_control_listener")]
    pub control_listener: Limits,
    /// The store that fleet-wide rules (`scope: fleet`) lease their shares
    /// from; without it they enforce their reserve.
    #[serde(default)]
    pub fleet: Option<FleetConfig>,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct InterfaceConfig {
    pub name: String,
    #[serde(default)]
    pub mode: Mode,
}

fn default_pin_dir() -> PathBuf {
    pins::DEFAULT_PIN_DIR.into()
}

fn default_socket() -> PathBuf {
    control::DEFAULT_SOCKET.into()
}

fn default_metrics() -> String {
    "127.0.0.1:9464".into()
}

fn default_control_listener() -> Limits {
    Limits {
        max_connections: 16,
        ..Limits::default()
    }
}

impl DaemonConfig {
    pub fn load(path: &Path) -> Result<Self> {
        let mut config: Self = crate::yaml::load(path)?;
        if config.rules.is_relative() {
            config.rules = path.parent().unwrap_or(Path::new(".")).join(&config.rules);
        }
        if let Some(fleet) = &config.fleet {
            fleet
                .validate("fleet")
                .with_context(|| path.display().to_string())?;
        }
        if config.interfaces.is_empty() {
            anyhow::bail!(
                "{}: interfaces: name at least one interface",
                path.display()
            );
        }
        Ok(config)
    }

    pub fn metrics_addr(&self) -> Result<Option<SocketAddr>> {
        if self.metrics == "off" {
            return Ok(None);
        }
        let addr: SocketAddr = self.metrics.parse().with_context(|| {
            format!(
                "metrics: {} is not host:port or `off`",
                crate::yaml::quoted(&self.metrics)
            )
        })?;
        if !addr.ip().is_loopback() {
            tracing::warn!(
                "metrics listen on {addr}, which is not a loopback address (as configured)"
            );
        }
        Ok(Some(addr))
    }
}
