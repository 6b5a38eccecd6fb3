//! A relayed connection: its requests read, judged and sent upstream one
//! after the other, each answer passed back as it comes, until the client
//! closes or the connection is handed over to hyper.

use std::{future::Future, net::SocketAddr, sync::Arc, time::Duration};

use bytes::{Buf, BytesMut};
use http::Method;
use tokio::{io::AsyncReadExt, net::TcpStream};

use super::{
    answer::{Body, Exchange, Framing, answer_head},
    io::{Deadline, client_gone, write_all, write_client},
    request::{Parsed, parse_request, write_request},
};
use crate::{
    http::{
        RateLimitLayer,
        proxy::{
            answers::{BAD_GATEWAY, log_unanswered},
            forward::{X_FORWARDED_FOR, forwarded_for},
            hop_by_hop::strip_hop_by_hop,
            target,
            upstream::Upstream,
        },
    },
    listen::{ConnectionError, Limits, Prefixed},
};

/// What relays requests for one worker.
pub struct Relay {
    pub layer: RateLimitLayer,
    pub upstream: Arc<Upstream>,
    /// The upstream's path, which requests' paths go under.
    pub base: Arc<str>,
    /// How long the upstream may take to answer, and pause within one.
    pub timeout: Duration,
}

/// The largest answer head taken from the upstream.
const MAX_ANSWER_HEAD: usize = 65536;
/// Room made in a buffer before each read.
const READ_SIZE: usize = 8192;

impl Relay {
    /// Serves the client at `peer` on `client` until it closes, or hands
    /// the connection over (see the module).
    pub async fn serve<F, Fut>(
        &self,
        mut client: TcpStream,
        peer: SocketAddr,
        limits: Limits,
        hand_over: F,
    ) -> Result<(), ConnectionError>
    where
        F: FnOnce(Prefixed<TcpStream>) -> Fut,
        Fut: Future<Output = hyper::Result<()>>,
    {
        let forwarded_for = forwarded_for(peer);
        let mut read = BytesMut::with_capacity(READ_SIZE);
        let mut answer = BytesMut::with_capacity(READ_SIZE);
        // What is written: to the upstream, and to the client.
        let (mut request_bytes, mut out) = (Vec::with_capacity(1024), Vec::with_capacity(1024));
        // Positions in a head are kept as u32.
        let max_head = limits.max_header_bytes.min(u32::MAX as usize);
        let (mut head_deadline, mut answer_deadline) = (Deadline::new(), Deadline::new());
        let handed_over = 'relay: loop {
            // Sent (begun) before the last answer ended: pipelined.
            let pipelined = !read.is_empty();
            // Idle or mid-head, a client has the header timeout.
            head_deadline.set(limits.header_timeout);
            let (mut request, close) = loop {
                match parse_request(&read) {
                    Parsed::Complete(head) if head.len <= max_head => match head.take(&mut read) {
                        Ok(taken) => break taken,
                        Err(all) => break 'relay all,
                    },
                    Parsed::Partial if read.len() < max_head => {}
                    _ => break 'relay read,
                }
                read.reserve(READ_SIZE);
                match head_deadline.within(client.read_buf(&mut read)).await {
                    // Closed, or silent past the deadline.
                    Some(Ok(0)) | None => return Ok(()),
                    Some(Ok(_)) => {}
                    Some(Err(e)) => return Err(e.into()),
                }
            };
            // Judged as forwarded: one host, one path.
            target::canonicalize(&mut request);
            let verdict = self.layer.judge(&request, Some(peer));
            let exchange = Exchange {
                fields: &verdict.fields,
                close,
                head: request.method() == Method::HEAD,
                safe: request.method().is_safe(),
            };
            out.clear();
            if let Some(refusal) = &verdict.refusal {
                exchange.write_own(&mut out, "429 Too Many Requests", refusal);
                write_client(&mut client, &out, limits).await?;
                if close {
                    return Ok(());
                }
                continue;
            }
            // Counted in flight until its answer has been passed on.
            let _in_flight = verdict.decision.in_flight;
            strip_hop_by_hop(request.headers_mut());
            request
                .headers_mut()
                .append(X_FORWARDED_FOR, forwarded_for.clone());
            request_bytes.clear();
            write_request(&mut request_bytes, &request, &self.base);
            let delay = Duration::from_nanos(verdict.decision.delay_ns);
            let asked = async {
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                let deadline = &mut answer_deadline;
                self.ask(&exchange, &request_bytes, &mut out, &mut answer, deadline)
                    .await
            };
            // A client that leaves while it waits takes its request with it.
            let asked = tokio::select! {
                biased;
                asked = asked => asked,
                () = client_gone(&client, pipelined || !read.is_empty()) => return Ok(()),
            };
            match asked {
                Ok((upstream, framing)) => {
                    let open = self
                        .relay_body(
                            &mut client,
                            upstream,
                            framing,
                            &mut out,
                            &mut answer,
                            limits,
                        )
                        .await?;
                    if !open {
                        return Ok(());
                    }
                }
                Err(e) => {
                    log_unanswered(&e);
                    out.clear();
                    exchange.write_own(&mut out, "502 Bad Gateway", BAD_GATEWAY);
                    write_client(&mut client, &out, limits).await?;
                }
            }
            if close {
                return Ok(());
            }
        };
        drop((answer, out, request_bytes, head_deadline, answer_deadline));
        let io = Prefixed::new(handed_over.freeze(), client);
        hand_over(io).await.map_err(Into::into)
    }

    /// Passes the rest of an answer whose head is in `out` (its first
    /// bytes perhaps in `answer`) to the client; whether the client's
    /// connection stays open. The upstream connection is kept if it is
    /// between messages at the end.
    async fn relay_body(
        &self,
        client: &mut TcpStream,
        mut upstream: TcpStream,
        framing: Framing,
        out: &mut Vec<u8>,
        answer: &mut BytesMut,
        limits: Limits,
    ) -> Result<bool, ConnectionError> {
        let Framing {
            mut body,
            reusable,
            close_client,
        } = framing;
        loop {
            let take = body.advance(answer)?;
            out.extend_from_slice(&answer[..take]);
            answer.advance(take);
            if !out.is_empty() {
                write_client(client, out, limits).await?;
                out.clear();
            }
            if body.done() {
                break;
            }
            answer.reserve(READ_SIZE);
            match tokio::time::timeout(self.timeout, upstream.read_buf(answer)).await {
                Ok(Ok(0)) if matches!(body, Body::UntilClose) => break,
                Ok(Ok(0)) => return Err("the upstream's answer was cut short".into()),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(e.into()),
                Err(_) => return Err("the upstream's answer stopped arriving".into()),
            }
        }
        // Anything after the answer was not asked for: not a connection to reuse.
        if reusable && answer.is_empty() && !matches!(body, Body::UntilClose) {
            self.upstream.give_back_stream(upstream);
        }
        answer.clear();
        Ok(!close_client)
    }

    /// Sends `request` and reads its answer's head (1xx answers skipped),
    /// written for the client in `out`, its bytes gone from `answer`: the
    /// connection, and how the body follows; all within the upstream
    /// timeout. A safe request (GET, HEAD) whose reused connection turns
    /// out closed before a byte of answer goes again on a new one, once.
    async fn ask(
        &self,
        exchange: &Exchange<'_>,
        request: &[u8],
        out: &mut Vec<u8>,
        answer: &mut BytesMut,
        deadline: &mut Deadline,
    ) -> anyhow::Result<(TcpStream, Framing)> {
        use anyhow::{Context, bail};
        deadline.set(self.timeout);
        let late = "the upstream did not answer in time";
        let mut first = true;
        loop {
            answer.clear();
            let connection = if first {
                deadline.within(self.upstream.stream()).await
            } else {
                let connecting = self.upstream.connect_stream();
                deadline
                    .within(async { Ok((connecting.await?, false)) })
                    .await
            };
            let (mut upstream, reused) = connection.context(late)??;
            let may_retry = reused && first && exchange.safe;
            first = false;
            match deadline.within(write_all(&mut upstream, request)).await {
                Some(Ok(())) => {}
                Some(Err(_)) if may_retry => continue,
                Some(Err(e)) => return Err(e).context("sending the request to the upstream"),
                None => bail!("the upstream did not take the request in time"),
            }
            let mut heard = false;
            loop {
                match answer_head(answer, out, exchange)? {
                    Some(framing) => return Ok((upstream, framing)),
                    None if answer.len() >= MAX_ANSWER_HEAD => {
                        bail!("the upstream's answer head is too large")
                    }
                    None => {}
                }
                answer.reserve(READ_SIZE);
                match deadline.within(upstream.read_buf(answer)).await {
                    Some(Ok(n)) if n > 0 => heard = true,
                    Some(_) if may_retry && !heard => break,
                    Some(Ok(_)) => bail!("the upstream closed the connection without answering"),
                    Some(Err(e)) => return Err(e).context("reading the upstream's answer"),
                    None => bail!(late),
                }
            }
        }
    }
}
