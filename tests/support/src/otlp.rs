//! An OpenTelemetry collector on loopback for tests: it takes spans over OTLP/gRPC (the trace
//! service) and over OTLP/HTTP (protobuf posted to `/v1/traces`) and keeps them, each with its
//! exporter's resource.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use prost::Message;

/// One span received.
#[derive(Clone, Debug)]
pub struct Span {
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent: String,
    /// The W3C `tracestate` it carries.
    pub trace_state: String,
    pub name: String,
    pub attributes: HashMap<String, String>,
    /// The (trace, span) ids it links to.
    pub links: Vec<(String, String)>,
    /// Its exporter's resource (`service.name`…).
    pub resource: HashMap<String, String>,
}

impl Span {
    pub fn service(&self) -> &str {
        self.resource
            .get("service.name")
            .map(String::as_str)
            .unwrap_or("")
    }

    pub fn attribute(&self, name: &str) -> Option<&str> {
        self.attributes.get(name).map(String::as_str)
    }
}

type Spans = Arc<Mutex<Vec<Span>>>;

/// A running collector; its servers stop with the test's runtime.
pub struct Collector {
    /// OTLP/gRPC.
    pub grpc: SocketAddr,
    /// OTLP/HTTP.
    pub http: SocketAddr,
    spans: Spans,
}

impl Collector {
    pub async fn start() -> Collector {
        let spans = Spans::default();
        let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let collector = Collector {
            grpc: grpc.local_addr().unwrap(),
            http: http.local_addr().unwrap(),
            spans: spans.clone(),
        };
        let service = TraceServiceServer::new(Receiver {
            spans: spans.clone(),
        });
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(grpc)),
        );
        let router = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |body: Bytes| {
                let spans = spans.clone();
                async move {
                    match ExportTraceServiceRequest::decode(body) {
                        Ok(request) => {
                            keep(&spans, request);
                            (
                                axum::http::StatusCode::OK,
                                [("content-type", "application/x-protobuf")],
                                ExportTraceServiceResponse::default().encode_to_vec(),
                            )
                        }
                        Err(_) => (
                            axum::http::StatusCode::BAD_REQUEST,
                            [("content-type", "text/plain")],
                            b"not an ExportTraceServiceRequest".to_vec(),
                        ),
                    }
                }
            }),
        );
        tokio::spawn(async move { axum::serve(http, router).await });
        collector
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Span> {
        self.spans.lock().unwrap().clone()
    }

    /// The spans received once `done` holds of them, waiting at most `limit`; panics naming
    /// `what` if it never does.
    pub async fn until(
        &self,
        what: &str,
        limit: Duration,
        done: impl Fn(&[Span]) -> bool,
    ) -> Vec<Span> {
        let deadline = Instant::now() + limit;
        loop {
            let spans = self.spans();
            if done(&spans) {
                return spans;
            }
            if Instant::now() > deadline {
                panic!(
                    "{what} within {limit:?}; received {} span(s): {spans:#?}",
                    spans.len()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

struct Receiver {
    spans: Spans,
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        keep(&self.spans, request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn keep(spans: &Spans, request: ExportTraceServiceRequest) {
    let mut kept = spans.lock().unwrap();
    for resource_spans in request.resource_spans {
        let resource = resource_spans
            .resource
            .map(|r| attributes(&r.attributes))
            .unwrap_or_default();
        for scope in resource_spans.scope_spans {
            for span in scope.spans {
                kept.push(Span {
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent: hex(&span.parent_span_id),
                    trace_state: span.trace_state,
                    name: span.name,
                    attributes: attributes(&span.attributes),
                    links: span
                        .links
                        .iter()
                        .map(|l| (hex(&l.trace_id), hex(&l.span_id)))
                        .collect(),
                    resource: resource.clone(),
                });
            }
        }
    }
}

fn attributes(pairs: &[KeyValue]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|kv| (kv.key.clone(), text(kv.value.as_ref())))
        .collect()
}

fn text(value: Option<&AnyValue>) -> String {
    match value.and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
