//! Where the leases live: the daemon's Redis settings. The password comes
//! from a file or an environment variable, never from the command line or
//! the URL, which process lists and logs show. `rediss://` speaks TLS
//! (rustls), verifying the server against the system's roots or a given
//! CA, with a client certificate when Redis asks for one.

use std::{
    io,
    path::{Path, PathBuf},
    time::Duration,
};

use redis::{IntoConnectionInfo, aio::ConnectionManagerConfig};
use serde::{Deserialize, Serialize};

/// The `store:` section of the daemon's configuration.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    /// `redis://host:port/db`, or `rediss://` for TLS.
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
    /// A Redis Cluster, `url` one of its nodes: the others are found from
    /// it. (The keys of one rule share a hash slot, so its scripts run
    /// there whole.)
    #[serde(default)]
    pub cluster: bool,
    /// TLS: the CA that signed the server's certificate (PEM); without
    /// it, the system's roots.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// TLS: a client certificate and its key (PEM), for a Redis that
    /// authenticates clients (`tls-auth-clients yes`).
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    #[serde(default)]
    pub key_file: Option<PathBuf>,
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
    #[error("store.password_env: {0} is not set")]
    PasswordEnv(String),
    #[error("store.{field} {}: {source}", path.display())]
    File {
        field: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("store.{0}: applies to rediss:// (TLS) only")]
    TlsOnly(&'static str),
    #[error("store: cert_file and key_file go together")]
    HalfAClientCertificate,
    /// Connecting failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
}

/// A file named by `store.<field>` that could not be read.
fn unreadable(field: &'static str, path: &Path) -> impl FnOnce(io::Error) -> StoreError {
    let path = path.to_owned();
    move |source| StoreError::File {
        field,
        path,
        source,
    }
}

impl StoreConfig {
    /// A store at `url` with no credentials and the default timeouts.
    pub fn at(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            user: None,
            password_file: None,
            password_env: None,
            cluster: false,
            ca_file: None,
            cert_file: None,
            key_file: None,
            connect_timeout: default_timeout(),
            response_timeout: default_timeout(),
        }
    }

    fn password(&self) -> Result<Option<String>, StoreError> {
        match (&self.password_file, &self.password_env) {
            (Some(_), Some(_)) => Err(StoreError::TwoPasswords),
            (Some(path), None) => std::fs::read_to_string(path)
                .map(|p| Some(p.trim_end_matches(['\n', '\r']).to_owned()))
                .map_err(unreadable("password_file", path)),
            (None, Some(name)) => std::env::var(name)
                .map(Some)
                .map_err(|_| StoreError::PasswordEnv(name.clone())),
            (None, None) => Ok(None),
        }
    }

    /// Where the store is, credentials set.
    fn connection_info(&self) -> Result<redis::ConnectionInfo, StoreError> {
        if self.url.contains("#insecure") {
            return Err(StoreError::Url(
                "#insecure turns off certificate checks; give the CA in store.ca_file instead"
                    .into(),
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
        Ok(info.set_redis_settings(settings))
    }

    /// The certificates of `rediss://`; `None` for `redis://`.
    fn certificates(&self) -> Result<Option<redis::TlsCertificates>, StoreError> {
        if !self.url.starts_with("rediss://") {
            let given = [
                ("ca_file", &self.ca_file),
                ("cert_file", &self.cert_file),
                ("key_file", &self.key_file),
            ];
            return match given.iter().find(|(_, f)| f.is_some()) {
                Some((field, _)) => Err(StoreError::TlsOnly(field)),
                None => Ok(None),
            };
        }
        let read = |field: &'static str, path: &Option<PathBuf>| {
            path.as_ref()
                .map(|p| std::fs::read(p).map_err(unreadable(field, p)))
                .transpose()
        };
        let client_tls = match (
            read("cert_file", &self.cert_file)?,
            read("key_file", &self.key_file)?,
        ) {
            (Some(client_cert), Some(client_key)) => Some(redis::ClientTlsConfig {
                client_cert,
                client_key,
            }),
            (None, None) => None,
            _ => return Err(StoreError::HalfAClientCertificate),
        };
        Ok(Some(redis::TlsCertificates {
            client_tls,
            root_cert: read("ca_file", &self.ca_file)?,
        }))
    }

    /// A client for one Redis, credentials (and TLS settings) set.
    pub fn client(&self) -> Result<redis::Client, StoreError> {
        let info = self.connection_info()?;
        match self.certificates()? {
            None => redis::Client::open(info),
            Some(certificates) => redis::Client::build_with_tls(info, certificates),
        }
        .map_err(|e| StoreError::Url(e.to_string()))
    }

    /// A client for a Redis Cluster, found from `url`.
    fn cluster_client(&self) -> Result<redis::cluster::ClusterClient, StoreError> {
        let mut builder = redis::cluster::ClusterClientBuilder::new(vec![self.connection_info()?])
            .retries(1)
            .connection_timeout(self.connect_timeout)
            .response_timeout(self.response_timeout);
        if let Some(certificates) = self.certificates()? {
            builder = builder.certs(certificates);
        }
        builder.build().map_err(|e| StoreError::Url(e.to_string()))
    }

    /// Checks the settings without connecting.
    pub fn check(&self) -> Result<(), StoreError> {
        if self.cluster {
            self.cluster_client().map(drop)
        } else {
            self.client().map(drop)
        }
    }

    /// Connects: to one Redis (reconnecting by itself), or to a cluster.
    pub async fn connect(&self) -> Result<Connection, StoreError> {
        Ok(if self.cluster {
            Connection::Cluster(self.cluster_client()?.get_async_connection().await?)
        } else {
            Connection::Single(
                redis::aio::ConnectionManager::new_with_config(
                    self.client()?,
                    self.manager_config(),
                )
                .await?,
            )
        })
    }

    /// Timeouts for the connection that reconnects by itself.
    fn manager_config(&self) -> ConnectionManagerConfig {
        // One retry: the fleet loop tries again every tick anyway, and a
        // store that refuses must not hold a tick for seconds of back-off.
        ConnectionManagerConfig::new()
            .set_number_of_retries(1)
            .set_connection_timeout(Some(self.connect_timeout))
            .set_response_timeout(Some(self.response_timeout))
    }
}

/// A connection to the store: one Redis or a cluster.
#[derive(Clone)]
pub enum Connection {
    Single(redis::aio::ConnectionManager),
    Cluster(redis::cluster_async::ClusterConnection),
}

impl redis::aio::ConnectionLike for Connection {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}
