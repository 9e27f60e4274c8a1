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

//!
//! Here the spans and the tracer; `propagation` reads the trace context callers send, `export`
//! sends finished spans to the collector from a thread of its own.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider, Tracer};
use tokio::sync::mpsc;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::Telemetry;

mod export;
mod propagation;

use export::{Queue, exporter_for};
pub use propagation::remote_context;

/// The `tracing` target of every span exported as a trace.
pub const TARGET: &str = sluice_core::observe::TRACES;

/// The most bytes of a string a span records (a domain, the rules matched, descriptor values, a
/// store error); a longer one keeps this much, on a character boundary, and is marked as cut.
const MAX_ATTRIBUTE_BYTES: usize = 256;

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
                            export::run(exporter, queue, &sent, &counted).await;
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
    use super::export::*;
    use super::propagation::*;
    use super::*;
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
    use opentelemetry_sdk::trace::{SpanData, SpanProcessor};
    use std::sync::atomic::Ordering;

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
