//! Where the leases live: the daemon's Redis settings. The password comes
//! from a file or an environment variable, never from the command line or
//! the URL, which process lists and logs show.

use std::{io, path::PathBuf, time::Duration};

use redis::{IntoConnectionInfo, aio::ConnectionManagerConfig};
use serde::{Deserialize, Serialize};

/// The `store:` section of the daemon's configuration.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    /// `redis://host:port/db`.
    pub url: String,
    /// An ACL user (Redis 6 and later); the default user without one.
    #[serde(default)]
    pub user: Option<String>,
    /// A file holding the password (trailing newline ignored).
    #[serde(default)]
    pub password_file: Option<PathBuf>,
    /// An environment variable holding the password.
    #[serde(default)]
    pub password_env: Option<String>,
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// How long one command may take (a lease renewal included).
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub response_timeout: Duration,
}

fn default_timeout() -> Duration {
    Duration::from_millis(500)
}

/// A store configuration that cannot be used, and why.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store.url: {0}")]
    Url(String),
    #[error(
        "store.url: the password belongs in store.password_file or store.password_env, \
         not in the URL (which process lists and logs show)"
    )]
    PasswordInUrl,
    #[error("store: password_file and password_env: give one")]
    TwoPasswords,
    #[error("store.password_file {}: {source}", path.display())]
    PasswordFile {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("store.password_env: {0} is not set")]
    PasswordEnv(String),
}

impl StoreConfig {
    /// A store at `url` with no credentials and the default timeouts.
    pub fn at(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            user: None,
            password_file: None,
            password_env: None,
            connect_timeout: default_timeout(),
            response_timeout: default_timeout(),
        }
    }

    fn password(&self) -> Result<Option<String>, StoreError> {
        match (&self.password_file, &self.password_env) {
            (Some(_), Some(_)) => Err(StoreError::TwoPasswords),
            (Some(path), None) => std::fs::read_to_string(path)
                .map(|p| Some(p.trim_end_matches(['\n', '\r']).to_owned()))
                .map_err(|source| StoreError::PasswordFile {
                    path: path.clone(),
                    source,
                }),
            (None, Some(name)) => std::env::var(name)
                .map(Some)
                .map_err(|_| StoreError::PasswordEnv(name.clone())),
            (None, None) => Ok(None),
        }
    }

    /// A client for the store, credentials set.
    pub fn client(&self) -> Result<redis::Client, StoreError> {
        if self.url.starts_with("rediss://") {
            return Err(StoreError::Url(
                "rediss:// (TLS) is not supported yet; use redis:// on a trusted network".into(),
            ));
        }
        let info = self
            .url
            .as_str()
            .into_connection_info()
            .map_err(|e| StoreError::Url(e.to_string()))?;
        if info.redis_settings().password().is_some() {
            return Err(StoreError::PasswordInUrl);
        }
        let mut settings = info.redis_settings().clone();
        if let Some(user) = &self.user {
            settings = settings.set_username(user);
        }
        if let Some(password) = self.password()? {
            settings = settings.set_password(password);
        }
        redis::Client::open(info.set_redis_settings(settings))
            .map_err(|e| StoreError::Url(e.to_string()))
    }

    /// Timeouts for the connection that reconnects by itself.
    pub fn manager_config(&self) -> ConnectionManagerConfig {
        ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.connect_timeout))
            .set_response_timeout(Some(self.response_timeout))
    }
}
