//! The trace context a caller sends: W3C `traceparent` and `tracestate` (cut to what W3C
//! requires be kept), else B3.

use opentelemetry::Context;
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
use opentelemetry_sdk::propagation::TraceContextPropagator;

/// The most of a caller's `tracestate` read: W3C requires keeping 32 members of at most 512
/// characters in all; members past either are ignored, so a span holds at most this much of it.
const TRACESTATE_MEMBERS: usize = 32;
pub(super) const TRACESTATE_BYTES: usize = 512;

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
pub(super) fn kept_tracestate(tracestate: &str) -> &str {
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
