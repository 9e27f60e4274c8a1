//! Traces: OpenTelemetry spans of each ShouldRateLimit call (continuing the trace Envoy sends in
//! W3C `traceparent` or B3 headers), of its store call, of the Redis script call it shared with
//! others (linked to each), and of the quota service's divisions, exported over OTLP (gRPC or
//! HTTP) to a collector.
//!
//! Spans are `tracing` spans of target `TARGET`, made OpenTelemetry spans by
//! `tracing-opentelemetry`; none is opened unless tracing is on (`on`). A finished span goes into
//! a queue, bounded in spans and in bytes, that a thread of its own empties, in batches, to the
//! collector: a collector that is slow, unreachable or gone never holds a decision up, nor makes
//! the process grow. A span the queue has no room for is dropped and counted, as is a batch the
//! collector refused (`sluice_trace_spans_total`). What a span holds is bounded too: every
//! string it records is cut (`cut`), and of a caller's `tracestate` only what W3C requires be
//! kept is read.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
use opentelemetry::{Context, KeyValue, Value};
use opentelemetry_otlp::{SpanExporter, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider, Span, SpanData, SpanProcessor, Tracer};
use tokio::sync::mpsc;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::Telemetry;
use sluice_core::throttle::Throttle;

/// The `tracing` target of every span exported as a trace.
pub const TARGET: &str = sluice_core::observe::TRACES;

/// Spans sent in one export at most.
const BATCH: usize = 512;
/// How often the spans queued are sent, whatever their number.
const EVERY: Duration = Duration::from_secs(1);
/// How long one export may take before its spans are counted as failed.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// The most bytes of a string a span records (a domain, the rules matched, descriptor values, a
/// store error); a longer one keeps this much, on a character boundary, and is marked as cut.
const MAX_ATTRIBUTE_BYTES: usize = 256;
/// The most of a caller's `tracestate` read: W3C requires keeping 32 members of at most 512
/// characters in all; members past either are ignored, so a span holds at most this much of it.
const TRACESTATE_MEMBERS: usize = 32;
const TRACESTATE_BYTES: usize = 512;
/// What a span's size is estimated at besides its strings: its fixed fields, and its share of
/// the allocations holding them.
const SPAN_OVERHEAD: usize = 512;

/// How traces reach the collector.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Protocol {
    /// OTLP over HTTP, protobuf bodies posted to the endpoint's `/v1/traces` (port 4318).
    Http,
    /// OTLP over gRPC (port 4317).
    Grpc,
}

/// Where and how traces go.
#[derive(Clone, Debug)]
pub struct TracingSettings {
    pub protocol: Protocol,
    /// The collector; `None`: as the OpenTelemetry environment says (`OTEL_EXPORTER_OTLP_ENDPOINT`
    /// and `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), else localhost on the protocol's port.
    pub endpoint: Option<String>,
    /// The share of traces sampled that no caller decided for, 0 to 1.
    pub sampling_rate: f64,
    pub service_name: String,
    pub service_namespace: Option<String>,
    /// `None`: a random one.
    pub service_instance_id: Option<String>,
    /// Spans waiting for export at most.
    pub queue: usize,
    /// Bytes of spans (as `estimate` counts them) waiting for export or being sent, at most.
    pub queue_bytes: usize,
    /// Whether spans carry descriptor values.
    pub values: bool,
}

/// Traces being exported: flushed when the process ends.
pub struct Traces {
    provider: SdkTracerProvider,
}

impl Traces {
    /// Starts the export thread and the tracer that feeds it, and turns spans on.
    pub fn start(
        settings: &TracingSettings,
        telemetry: &Telemetry,
    ) -> anyhow::Result<(Traces, Tracer)> {
        let (spans, queue) = mpsc::channel(settings.queue.max(1));
        let held = Arc::new(AtomicUsize::new(0));
        let sent = held.clone();
        let resource = resource(settings);
        let (built, exporter) = std::sync::mpsc::channel();
        let protocol = settings.protocol;
        let endpoint = settings.endpoint.clone();
        let exported = resource.clone();
        let counted = telemetry.clone();
        std::thread::Builder::new()
            .name("sluice-traces".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        let _ = built.send(Err(anyhow::Error::from(e)));
                        return;
                    }
                };
                runtime.block_on(async move {
                    match exporter_for(protocol, endpoint.as_deref()) {
                        Ok(mut exporter) => {
                            use opentelemetry_sdk::trace::SpanExporter as _;
                            exporter.set_resource(&exported);
                            let _ = built.send(Ok(()));
                            export(exporter, queue, &sent, &counted).await;
                        }
                        Err(e) => {
                            let _ = built.send(Err(e));
                        }
                    }
                });
            })?;
        exporter
            .recv()
            .map_err(|_| anyhow::anyhow!("the trace export thread ended while starting"))??;
        let provider = SdkTracerProvider::builder()
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                settings.sampling_rate,
            ))))
            .with_resource(resource)
            .with_span_processor(Queue {
                spans,
                held,
                budget: settings.queue_bytes,
                telemetry: telemetry.clone(),
            })
            .build();
        let tracer = provider.tracer("sluice");
        telemetry.trace(settings.values);
        Ok((Traces { provider }, tracer))
    }

    /// Sends the spans still queued, waiting at most `within`.
    pub fn flush(&self, within: Duration) {
        if let Err(e) = self.provider.shutdown_with_timeout(within) {
            tracing::warn!("traces: the last spans were not all sent: {e}");
        }
    }
}

/// The resource every span is of: the service's name, namespace and instance, over what the
/// OpenTelemetry environment says (`OTEL_RESOURCE_ATTRIBUTES`).
fn resource(settings: &TracingSettings) -> Resource {
    let instance = settings
        .service_instance_id
        .clone()
        .unwrap_or_else(random_id);
    let mut builder = Resource::builder()
        .with_service_name(settings.service_name.clone())
        .with_attribute(KeyValue::new("service.instance.id", instance));
    if let Some(namespace) = &settings.service_namespace {
        builder = builder.with_attribute(KeyValue::new("service.namespace", namespace.clone()));
    }
    builder.build()
}

/// A random 128-bit id, as a UUID is written.
fn random_id() -> String {
    use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator};
    let hex = RandomIdGenerator::default().new_trace_id().to_string();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

/// The OTLP exporter for `protocol`, to `endpoint` (for HTTP, a bare address gets the traces
/// path) or where the environment says. Built on the export thread's runtime, which drives its
/// connections.
fn exporter_for(protocol: Protocol, endpoint: Option<&str>) -> anyhow::Result<SpanExporter> {
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
fn traces_url(url: &str) -> String {
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
enum Message {
    /// A span and its estimated size.
    Span(Box<SpanData>, usize),
    /// Send what is queued, then say so.
    Flush(std::sync::mpsc::Sender<()>),
}

/// The span processor: each sampled span that ends goes into the export thread's queue, or is
/// dropped and counted when the queue is full, in spans or in bytes.
#[derive(Debug)]
struct Queue {
    spans: mpsc::Sender<Message>,
    /// The estimated bytes of the spans queued or being sent.
    held: Arc<AtomicUsize>,
    /// What `held` may reach.
    budget: usize,
    /// Told of the spans dropped.
    telemetry: Telemetry,
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
fn estimate(span: &SpanData) -> usize {
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
async fn export(
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
    static FAILED: Throttle = Throttle::new();
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

/// The trace context a call's gRPC metadata carries: W3C `traceparent`, else B3 (`b3` or
/// `x-b3-*`, as Envoy's Zipkin tracer sends it), else none.
pub fn remote_context(metadata: &tonic::metadata::MetadataMap) -> Context {
    use opentelemetry::trace::TraceContextExt as _;
    let w3c = TraceContextPropagator::new().extract(&Metadata(metadata));
    if w3c.span().span_context().is_valid() {
        return w3c;
    }
    match b3(metadata) {
        Some(caller) => Context::new().with_remote_span_context(caller),
        None => Context::new(),
    }
}

/// B3's span context: one `b3` header (`trace-span[-sampled[-parent]]`), or `x-b3-traceid`,
/// `x-b3-spanid` and `x-b3-sampled` (`x-b3-flags: 1`, debug, is sampled). Without a sampling
/// decision, the caller is taken not to have sampled it.
fn b3(metadata: &tonic::metadata::MetadataMap) -> Option<SpanContext> {
    let get = |key: &str| metadata.get(key).and_then(|v| v.to_str().ok());
    let (trace, span, sampled) = match get("b3") {
        Some(single) => {
            let mut parts = single.split('-');
            (parts.next()?, parts.next()?, parts.next())
        }
        None => (
            get("x-b3-traceid")?,
            get("x-b3-spanid")?,
            match get("x-b3-flags") {
                Some("1") => Some("d"),
                _ => get("x-b3-sampled"),
            },
        ),
    };
    let hex = |s: &str| {
        s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let trace_id = match trace.len() {
        16 | 32 if hex(trace) => TraceId::from_hex(&format!("{trace:0>32}")).ok()?,
        _ => return None,
    };
    let span_id = match span.len() {
        16 if hex(span) => SpanId::from_hex(span).ok()?,
        _ => return None,
    };
    let flags = match sampled {
        Some("1" | "d" | "true") => TraceFlags::SAMPLED,
        _ => TraceFlags::default(),
    };
    let caller = SpanContext::new(trace_id, span_id, flags, true, TraceState::default());
    caller.is_valid().then_some(caller)
}

/// Reads trace headers from gRPC metadata, `tracestate` cut to what W3C requires be kept.
struct Metadata<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for Metadata<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        let value = self.0.get(key).and_then(|v| v.to_str().ok())?;
        Some(if key == "tracestate" {
            kept_tracestate(value)
        } else {
            value
        })
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// The members at the head of `tracestate` that fit both `TRACESTATE_MEMBERS` and
/// `TRACESTATE_BYTES`, whole; the rest is ignored (W3C lets a vendor drop members past these).
fn kept_tracestate(tracestate: &str) -> &str {
    if tracestate.len() <= TRACESTATE_BYTES
        && tracestate.bytes().filter(|&b| b == b',').count() < TRACESTATE_MEMBERS
    {
        return tracestate;
    }
    let mut end = 0;
    for (members, (at, _)) in tracestate.match_indices(',').enumerate() {
        if at > TRACESTATE_BYTES || members >= TRACESTATE_MEMBERS {
            break;
        }
        end = at;
    }
    &tracestate[..end]
}

/// `text` as a span records it: at most `MAX_ATTRIBUTE_BYTES` of it, cut on a character boundary
/// and then marked with its length, so that no client's bytes make a span large.
pub fn cut(text: impl std::fmt::Display) -> String {
    let mut kept = Kept::default();
    let _ = write!(kept, "{text}");
    if kept.cut {
        let _ = write!(kept.text, "…[cut: {} bytes]", kept.total);
    }
    kept.text
}

/// What `cut` keeps of a text written piece by piece.
#[derive(Default)]
struct Kept {
    text: String,
    /// Bytes written, kept or not.
    total: usize,
    /// Something was left out: nothing written after it is kept.
    cut: bool,
}

impl std::fmt::Write for Kept {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.total += s.len();
        if self.cut {
            return Ok(());
        }
        let room = MAX_ATTRIBUTE_BYTES - self.text.len();
        if s.len() <= room {
            self.text.push_str(s);
        } else {
            let mut end = room;
            while !s.is_char_boundary(end) {
                end -= 1;
            }
            self.text.push_str(&s[..end]);
            self.cut = true;
        }
        Ok(())
    }
}

/// A ShouldRateLimit call's span, continuing the trace its caller sent; none when tracing is
/// off. Named as gRPC instrumentation names a server call, as envoyproxy/ratelimit's are.
pub fn call_span(telemetry: &Telemetry, metadata: &tonic::metadata::MetadataMap) -> tracing::Span {
    if !telemetry.tracing() {
        return tracing::Span::none();
    }
    let span = tracing::info_span!(
        target: TARGET,
        "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
        otel.kind = "server",
        rpc.system = "grpc",
        rpc.service = "envoy.service.ratelimit.v3.RateLimitService",
        rpc.method = "ShouldRateLimit",
        ratelimit.domain = tracing::field::Empty,
        ratelimit.rules = tracing::field::Empty,
        ratelimit.descriptors = tracing::field::Empty,
        ratelimit.decision = tracing::field::Empty,
        ratelimit.policy_answer = tracing::field::Empty,
        ratelimit.store_error = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    );
    continue_from(&span, remote_context(metadata));
    span
}

/// The span of a store call made within the current span; none when tracing is off or the
/// current span is not traced.
pub fn store_span(telemetry: &Telemetry, counters: usize) -> tracing::Span {
    if !telemetry.tracing() || tracing::Span::current().is_none() {
        return tracing::Span::none();
    }
    tracing::info_span!(
        target: TARGET,
        "store",
        sluice.counters = counters,
        ratelimit.store_error = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    )
}

/// One division of a quota bucket of `rule` among `streams` streams, its store call included: a
/// trace of its own (a division serves every stream of its bucket, not one call); none when
/// tracing is off.
pub fn division_span(telemetry: &Telemetry, rule: &str, streams: usize) -> tracing::Span {
    if !telemetry.tracing() {
        return tracing::Span::none();
    }
    tracing::info_span!(
        target: TARGET,
        parent: None,
        "quota division",
        quota.rule = %cut(rule),
        quota.streams = streams,
        ratelimit.store_error = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    )
}

/// Names `error` as the store error of `span`, which it failed with.
pub fn store_failed(span: &tracing::Span, error: &dyn std::fmt::Display) {
    if !span.is_none() {
        span.record("ratelimit.store_error", cut(error).as_str());
        span.record("otel.status_code", "error");
    }
}

/// Makes `span` a child of `parent` when `parent` holds a remote span context.
fn continue_from(span: &tracing::Span, parent: Context) {
    use opentelemetry::trace::TraceContextExt as _;
    if parent.span().span_context().is_valid() {
        let _ = span.set_parent(parent);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_http_endpoint_without_a_path_gets_the_traces_path() {
        assert_eq!(
            traces_url("http://collector:4318"),
            "http://collector:4318/v1/traces"
        );
        assert_eq!(
            traces_url("http://collector:4318/"),
            "http://collector:4318/v1/traces"
        );
        assert_eq!(
            traces_url("https://collector/otlp/v1/traces"),
            "https://collector/otlp/v1/traces"
        );
    }

    #[test]
    fn a_random_instance_id_is_written_as_a_uuid() {
        let id = random_id();
        let groups: Vec<usize> = id.split('-').map(str::len).collect();
        assert_eq!(groups, [8, 4, 4, 4, 12]);
        assert_ne!(id, random_id());
    }

    #[test]
    fn a_string_past_the_bound_is_cut_on_a_character_boundary_and_marked() {
        assert_eq!(cut("short"), "short");
        let exact = "x".repeat(MAX_ATTRIBUTE_BYTES);
        assert_eq!(cut(&exact), exact);
        let long = format!(
            "{}é{}",
            "x".repeat(MAX_ATTRIBUTE_BYTES - 1),
            "y".repeat(1000)
        );
        assert_eq!(
            cut(&long),
            format!(
                "{}…[cut: {} bytes]",
                "x".repeat(MAX_ATTRIBUTE_BYTES - 1),
                long.len()
            )
        );
        // Written in pieces, nothing after the first piece cut is kept, even if it would fit.
        let pieces = format_args!("{}{}{}", "x".repeat(MAX_ATTRIBUTE_BYTES - 1), "é", "z");
        assert_eq!(
            cut(pieces),
            format!(
                "{}…[cut: {} bytes]",
                "x".repeat(MAX_ATTRIBUTE_BYTES - 1),
                MAX_ATTRIBUTE_BYTES + 2
            )
        );
    }

    #[test]
    fn of_a_tracestate_whole_members_within_32_and_512_characters_are_read() {
        assert_eq!(kept_tracestate("a=1,b=2"), "a=1,b=2");
        let member = format!("m={}", "v".repeat(198));
        let three = [member.as_str(); 3].join(",");
        assert_eq!(kept_tracestate(&three), [member.as_str(); 2].join(","));
        let many: Vec<String> = (0..40).map(|i| format!("k{i}=v")).collect();
        assert_eq!(kept_tracestate(&many.join(",")), many[..32].join(","));
        assert_eq!(kept_tracestate(&"v".repeat(600)), "");
    }

    /// A sampled span with one attribute of `bytes` bytes.
    fn span_of(bytes: usize) -> SpanData {
        use opentelemetry::InstrumentationScope;
        use opentelemetry::trace::{SpanKind, Status};
        let context = SpanContext::new(
            TraceId::from(1),
            SpanId::from(1),
            TraceFlags::SAMPLED,
            false,
            TraceState::default(),
        );
        SpanData {
            span_context: context,
            parent_span_id: SpanId::INVALID,
            parent_span_is_remote: false,
            span_kind: SpanKind::Server,
            name: "call".into(),
            start_time: std::time::SystemTime::UNIX_EPOCH,
            end_time: std::time::SystemTime::UNIX_EPOCH,
            attributes: vec![KeyValue::new("k", "v".repeat(bytes))],
            dropped_attributes_count: 0,
            events: Default::default(),
            links: Default::default(),
            status: Status::Unset,
            instrumentation_scope: InstrumentationScope::builder("test").build(),
        }
    }

    #[test]
    fn spans_past_the_queues_bytes_are_dropped_and_sent_ones_give_their_bytes_back() {
        let size = estimate(&span_of(1000));
        assert!(size > 1000, "{size}");
        let (spans, mut queue) = mpsc::channel(100);
        let held = Arc::new(AtomicUsize::new(0));
        let telemetry = Telemetry::new();
        let processor = Queue {
            spans,
            held: held.clone(),
            budget: 3 * size,
            telemetry: telemetry.clone(),
        };
        for _ in 0..5 {
            processor.on_end(span_of(1000));
        }
        let mut queued = 0;
        while let Ok(Message::Span(_, bytes)) = queue.try_recv() {
            assert_eq!(bytes, size);
            queued += 1;
        }
        assert_eq!(queued, 3, "the budget holds three");
        assert_eq!(held.load(Ordering::Relaxed), 3 * size);
        // Until the export thread has sent them, they still count.
        processor.on_end(span_of(1000));
        assert!(queue.try_recv().is_err());
        held.fetch_sub(3 * size, Ordering::Relaxed);
        processor.on_end(span_of(1000));
        assert!(matches!(queue.try_recv(), Ok(Message::Span(..))));
        let metrics = telemetry.metrics().encode(&Default::default()).unwrap();
        assert!(
            metrics.contains("sluice_trace_spans_total{outcome=\"dropped\"} 3"),
            "{metrics}"
        );
    }

    #[test]
    fn the_callers_trace_is_read_from_traceparent_or_b3() {
        use opentelemetry::trace::TraceContextExt as _;
        let mut w3c = tonic::metadata::MetadataMap::new();
        w3c.insert(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
                .parse()
                .unwrap(),
        );
        let cx = remote_context(&w3c);
        let span = cx.span();
        let found = span.span_context();
        assert_eq!(
            found.trace_id().to_string(),
            "0af7651916cd43dd8448eb211c80319c"
        );
        assert_eq!(found.span_id().to_string(), "b7ad6b7169203331");
        assert!(found.is_sampled());

        let mut b3 = tonic::metadata::MetadataMap::new();
        b3.insert(
            "x-b3-traceid",
            "80f198ee56343ba864fe8b2a57d3eff7".parse().unwrap(),
        );
        b3.insert("x-b3-spanid", "e457b5a2e4d86bd1".parse().unwrap());
        b3.insert("x-b3-sampled", "1".parse().unwrap());
        let cx = remote_context(&b3);
        let span = cx.span();
        assert_eq!(
            span.span_context().trace_id().to_string(),
            "80f198ee56343ba864fe8b2a57d3eff7"
        );

        assert!(span.span_context().is_sampled());

        let mut single = tonic::metadata::MetadataMap::new();
        single.insert("b3", "64fe8b2a57d3eff7-e457b5a2e4d86bd1-0".parse().unwrap());
        let cx = remote_context(&single);
        let span = cx.span();
        assert_eq!(
            span.span_context().trace_id().to_string(),
            "000000000000000064fe8b2a57d3eff7"
        );
        assert!(!span.span_context().is_sampled());

        let mut bad = tonic::metadata::MetadataMap::new();
        bad.insert("b3", "XYZ-e457b5a2e4d86bd1-1".parse().unwrap());
        bad.insert("traceparent", "00-zz-b7ad6b7169203331-01".parse().unwrap());
        assert!(!remote_context(&bad).span().span_context().is_valid());
        let cx = remote_context(&tonic::metadata::MetadataMap::new());
        assert!(!cx.span().span_context().is_valid());
    }
}
