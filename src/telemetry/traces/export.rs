//! The export: a queue bounded in spans and bytes, emptied in batches by a thread of its own
//! to an OTLP collector, counting what is dropped or refused.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use opentelemetry::{Context, KeyValue, Value};
use opentelemetry_otlp::{SpanExporter, WithExportConfig};
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{Span, SpanData, SpanProcessor};
use tokio::sync::mpsc;

use super::{Protocol, Telemetry};
use sluice_core::log_throttle::LogThrottle;

use super::propagation::TRACESTATE_BYTES;

/// Spans sent in one export at most.
const BATCH: usize = 512;
/// How often the spans queued are sent, whatever their number.
const EVERY: Duration = Duration::from_secs(1);
/// How long one export may take before its spans are counted as failed.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// What a span's size is estimated at besides its strings: its fixed fields, and its share of
/// the allocations holding them.
const SPAN_OVERHEAD: usize = 512;

/// The OTLP exporter for `protocol`, to `endpoint` (for HTTP, a bare address gets the traces
/// path) or where the environment says. Built on the export thread's runtime, which drives its
/// connections.
pub(super) fn exporter_for(
    protocol: Protocol,
    endpoint: Option<&str>,
) -> anyhow::Result<SpanExporter> {
    let exporter = match protocol {
        Protocol::Http => {
            let builder = SpanExporter::builder().with_http();
            match endpoint {
                Some(url) => builder.with_endpoint(traces_url(url)).build(),
                None => builder.build(),
            }
        }
        Protocol::Grpc => {
            let builder = SpanExporter::builder().with_tonic();
            match endpoint {
                Some(url) => builder.with_endpoint(url).build(),
                None => builder.build(),
            }
        }
    };
    exporter.map_err(|e| anyhow::anyhow!("the OTLP trace exporter: {e}"))
}

/// `url` with OTLP/HTTP's traces path when it has no path of its own.
pub(super) fn traces_url(url: &str) -> String {
    let trimmed = url.trim_end_matches('/');
    let path_less = trimmed
        .split_once("://")
        .is_some_and(|(_, rest)| !rest.contains('/'));
    if path_less {
        format!("{trimmed}/v1/traces")
    } else {
        url.to_owned()
    }
}

/// What the processor hands the export thread.
pub(super) enum Message {
    /// A span and its estimated size.
    Span(Box<SpanData>, usize),
    /// Send what is queued, then say so.
    Flush(std::sync::mpsc::Sender<()>),
}

/// The span processor: each sampled span that ends goes into the export thread's queue, or is
/// dropped and counted when the queue is full, in spans or in bytes.
#[derive(Debug)]
pub(super) struct Queue {
    pub(super) spans: mpsc::Sender<Message>,
    /// The estimated bytes of the spans queued or being sent.
    pub(super) held: Arc<AtomicUsize>,
    /// What `held` may reach.
    pub(super) budget: usize,
    /// Told of the spans dropped.
    pub(super) telemetry: Telemetry,
}

impl SpanProcessor for Queue {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        let size = estimate(&span);
        let before = self.held.fetch_add(size, Ordering::Relaxed);
        let queued = before + size <= self.budget
            && self
                .spans
                .try_send(Message::Span(Box::new(span), size))
                .is_ok();
        if !queued {
            self.held.fetch_sub(size, Ordering::Relaxed);
            self.telemetry.trace_spans("dropped", 1);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.flush(EXPORT_TIMEOUT)
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.flush(timeout)
    }
}

impl Queue {
    /// Has the export thread send what is queued, waiting at most `within`.
    fn flush(&self, within: Duration) -> OTelSdkResult {
        let (done, flushed) = std::sync::mpsc::channel();
        self.spans.try_send(Message::Flush(done)).map_err(|_| {
            OTelSdkError::InternalFailure("the span queue is full or closed".into())
        })?;
        flushed
            .recv_timeout(within)
            .map_err(|_| OTelSdkError::Timeout(within))
    }
}

/// A span's size in memory, roughly: its strings (name, attributes, events, links) and
/// `SPAN_OVERHEAD` for the rest, the caller's `tracestate` (at most `TRACESTATE_BYTES`)
/// included.
pub(super) fn estimate(span: &SpanData) -> usize {
    let attributes = |attributes: &[KeyValue]| -> usize {
        attributes
            .iter()
            .map(|kv| {
                let value = match &kv.value {
                    Value::String(s) => s.as_str().len(),
                    Value::Bool(_) | Value::I64(_) | Value::F64(_) => 8,
                    other => other.as_str().len(),
                };
                std::mem::size_of::<KeyValue>() + kv.key.as_str().len() + value
            })
            .sum()
    };
    let events: usize = span
        .events
        .iter()
        .map(|e| e.name.len() + attributes(&e.attributes) + SPAN_OVERHEAD / 4)
        .sum();
    let links: usize = span
        .links
        .iter()
        .map(|l| attributes(&l.attributes) + TRACESTATE_BYTES + SPAN_OVERHEAD / 4)
        .sum();
    SPAN_OVERHEAD
        + TRACESTATE_BYTES
        + span.name.len()
        + attributes(&span.attributes)
        + events
        + links
}

/// Spans taken from the queue, waiting to be sent, and their estimated bytes.
struct Batch {
    spans: Vec<SpanData>,
    bytes: usize,
}

/// Sends the spans `queue` brings to `exporter`, in batches of at most `BATCH`, every `EVERY`
/// and when a batch is full; one export at a time, the queue filling meanwhile. The bytes of a
/// batch leave `held` once it is sent (or failed): until then they are still in memory.
pub(super) async fn run(
    exporter: SpanExporter,
    mut queue: mpsc::Receiver<Message>,
    held: &AtomicUsize,
    telemetry: &Telemetry,
) {
    let mut batch = Batch {
        spans: Vec::with_capacity(BATCH),
        bytes: 0,
    };
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            message = queue.recv() => match message {
                Some(Message::Span(span, size)) => {
                    batch.spans.push(*span);
                    batch.bytes += size;
                    if batch.spans.len() >= BATCH {
                        send(&exporter, &mut batch, held, telemetry).await;
                    }
                }
                Some(Message::Flush(done)) => {
                    send(&exporter, &mut batch, held, telemetry).await;
                    let _ = done.send(());
                }
                None => {
                    send(&exporter, &mut batch, held, telemetry).await;
                    return;
                }
            },
            _ = tick.tick() => send(&exporter, &mut batch, held, telemetry).await,
        }
    }
}

/// Exports `batch`, counting its spans as exported or failed, and takes its bytes off `held`.
async fn send(
    exporter: &SpanExporter,
    batch: &mut Batch,
    held: &AtomicUsize,
    telemetry: &Telemetry,
) {
    use opentelemetry_sdk::trace::SpanExporter as _;
    static FAILED: LogThrottle = LogThrottle::new();
    if batch.spans.is_empty() {
        return;
    }
    let spans = std::mem::replace(&mut batch.spans, Vec::with_capacity(BATCH));
    let bytes = std::mem::take(&mut batch.bytes);
    let n = spans.len() as u64;
    let exported = tokio::time::timeout(EXPORT_TIMEOUT, exporter.export(spans)).await;
    held.fetch_sub(bytes, Ordering::Relaxed);
    let why = match exported {
        Ok(Ok(())) => {
            telemetry.trace_spans("exported", n);
            return;
        }
        Ok(Err(e)) => e.to_string(),
        Err(_) => format!("no answer within {}s", EXPORT_TIMEOUT.as_secs()),
    };
    telemetry.trace_spans("failed", n);
    if let Some(times) = FAILED.hit() {
        tracing::warn!("traces: {times} export(s) failed since the last report: {why}");
    }
}
