//! The listeners' TLS: a server configuration from PEM files.

use std::{path::Path, sync::Arc};

/// A TLS server configuration from a certificate chain and its key (PEM
/// files), offering HTTP/2 and HTTP/1.1 by ALPN.
pub fn tls_acceptor(cert: &Path, key: &Path) -> anyhow::Result<tokio_rustls::TlsAcceptor> {
    use anyhow::Context;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(Iterator::collect::<Result<Vec<_>, _>>)
        .with_context(|| format!("--tls-cert {}", cert.display()))?;
    if chain.is_empty() {
        anyhow::bail!("--tls-cert {}: no PEM certificate in it", cert.display());
    }
    let key = PrivateKeyDer::from_pem_file(key)
        .with_context(|| format!("--tls-key {}", key.display()))?;
    let mut config = rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .context("--tls-cert and --tls-key do not make a certificate and its key")?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}
