//! Traces: OpenTelemetry spans of each ShouldRateLimit call (continuing the trace Envoy sends in
//! W3C `traceparent` or B3 headers), of its store call, of the Redis script call it shared with
//! others (linked to each), and of the quota service's divisions, exported over OTLP (gRPC or
//! HTTP) to a collector.
//!
//! Spans are `tracing` spans of target `TARGET`, made OpenTelemetry spans by
//! `tracing-opentelemetry`; none is opened unless tracing is on (`on`). A finished span goes into
//! a bounded queue that a thread of its own empties, in batches, to the collector: a collector
//! that is slow, unreachable or gone never holds a decision up. A span the queue has no room for
//! is dropped and counted, as is a batch the collector refused (`sluice_trace_spans_total`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{SpanExporter, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider, Span, SpanData, SpanProcessor, Tracer};
use tokio::sync::mpsc;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::Throttle;
use super::metrics::METRICS;

/// The `tracing` target of every span exported as a trace.
pub const TARGET: &str = "sluice::traces";

/// Spans sent in one export at most.
const BATCH: usize = 512;
/// How often the spans queued are sent, whatever their number.
const EVERY: Duration = Duration::from_secs(1);
/// How long one export may take before its spans are counted as failed.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

static ON: AtomicBool = AtomicBool::new(false);
static VALUES: AtomicBool = AtomicBool::new(false);

/// Whether spans are opened at all.
pub fn on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Whether spans may carry descriptor values (`--tracing-values`), which can be personal data.
pub fn values() -> bool {
    VALUES.load(Ordering::Relaxed)
}

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
    /// Whether spans carry descriptor values.
    pub values: bool,
}

/// Traces being exported: flushed when the process ends.
pub struct Traces {
    provider: SdkTracerProvider,
}

impl Traces {
    /// Starts the export thread and the tracer that feeds it, and turns spans on.
    pub fn start(settings: &TracingSettings) -> anyhow::Result<(Traces, Tracer)> {
        let (spans, queue) = mpsc::channel(settings.queue.max(1));
        let resource = resource(settings);
        let (built, exporter) = std::sync::mpsc::channel();
        let protocol = settings.protocol;
        let endpoint = settings.endpoint.clone();
        let exported = resource.clone();
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
                            export(exporter, queue).await;
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
            .with_span_processor(Queue { spans })
            .build();
        let tracer = provider.tracer("sluice");
        ON.store(true, Ordering::Relaxed);
        VALUES.store(settings.values, Ordering::Relaxed);
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
    Span(Box<SpanData>),
    /// Send what is queued, then say so.
    Flush(std::sync::mpsc::Sender<()>),
}

/// The span processor: each sampled span that ends goes into the export thread's queue, or is
/// dropped and counted when the queue is full.
#[derive(Debug)]
struct Queue {
    spans: mpsc::Sender<Message>,
}

impl SpanProcessor for Queue {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        if self.spans.try_send(Message::Span(Box::new(span))).is_err() {
            METRICS.trace_spans("dropped", 1);
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

/// Sends the spans `queue` brings to `exporter`, in batches of at most `BATCH`, every `EVERY`
/// and when a batch is full; one export at a time, the queue filling meanwhile.
async fn export(exporter: SpanExporter, mut queue: mpsc::Receiver<Message>) {
    let mut batch = Vec::with_capacity(BATCH);
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            message = queue.recv() => match message {
                Some(Message::Span(span)) => {
                    batch.push(*span);
                    if batch.len() >= BATCH {
                        send(&exporter, &mut batch).await;
                    }
                }
                Some(Message::Flush(done)) => {
                    send(&exporter, &mut batch).await;
                    let _ = done.send(());
                }
                None => {
                    send(&exporter, &mut batch).await;
                    return;
                }
            },
            _ = tick.tick() => send(&exporter, &mut batch).await,
        }
    }
}

/// Exports `batch`, counting its spans as exported or failed.
async fn send(exporter: &SpanExporter, batch: &mut Vec<SpanData>) {
    use opentelemetry_sdk::trace::SpanExporter as _;
    static FAILED: Throttle = Throttle::new();
    if batch.is_empty() {
        return;
    }
    let spans = std::mem::replace(batch, Vec::with_capacity(BATCH));
    let n = spans.len() as u64;
    let why = match tokio::time::timeout(EXPORT_TIMEOUT, exporter.export(spans)).await {
        Ok(Ok(())) => {
            METRICS.trace_spans("exported", n);
            return;
        }
        Ok(Err(e)) => e.to_string(),
        Err(_) => format!("no answer within {}s", EXPORT_TIMEOUT.as_secs()),
    };
    METRICS.trace_spans("failed", n);
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

/// Reads trace headers from gRPC metadata.
struct Metadata<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for Metadata<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
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

/// A ShouldRateLimit call's span, continuing the trace its caller sent; none when tracing is
/// off. Named as gRPC instrumentation names a server call, as envoyproxy/ratelimit's are.
pub fn call_span(metadata: &tonic::metadata::MetadataMap) -> tracing::Span {
    if !on() {
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
pub fn store_span(counters: usize) -> tracing::Span {
    if !on() || tracing::Span::current().is_none() {
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

/// The span of one Redis script call carrying the requests whose store spans are `requests`:
/// a child of the first traced one, linked to every other (they share it); none when none is
/// traced.
pub fn script_span<'a>(
    mut requests: impl Iterator<Item = &'a tracing::Span>,
    counters: usize,
) -> tracing::Span {
    if !on() {
        return tracing::Span::none();
    }
    let Some(first) = requests.find(|s| !s.is_none()) else {
        return tracing::Span::none();
    };
    let span = tracing::info_span!(
        target: TARGET,
        parent: first,
        "redis EVALSHA",
        otel.kind = "client",
        db.system = "redis",
        sluice.requests = 1,
        sluice.counters = counters,
    );
    let mut carried = 1;
    for other in requests.filter(|s| !s.is_none()) {
        span.follows_from(other);
        carried += 1;
    }
    span.record("sluice.requests", carried);
    span
}

/// One division of a quota bucket of `rule` among `streams` streams, its store call included: a
/// trace of its own (a division serves every stream of its bucket, not one call); none when
/// tracing is off.
pub fn division_span(rule: &str, streams: usize) -> tracing::Span {
    if !on() {
        return tracing::Span::none();
    }
    tracing::info_span!(
        target: TARGET,
        parent: None,
        "quota division",
        quota.rule = rule,
        quota.streams = streams,
        ratelimit.store_error = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    )
}

/// Names `error` as the store error of `span`, which it failed with.
pub fn store_failed(span: &tracing::Span, error: &dyn std::fmt::Display) {
    if !span.is_none() {
        span.record("ratelimit.store_error", tracing::field::display(error));
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
