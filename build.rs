//! Compiles `proto/` twice. As written upstream, into one file descriptor set embedded in the
//! binary for gRPC server reflection and for the protobuf JSON mapping of the admin `/json`
//! endpoint. And into the Rust types and servers of `envoy.service.ratelimit.v3` and
//! `envoy.service.rate_limit_quota.v3`, with the request's domain and entry keys and values, and a
//! quota bucket id's values, read as `bytes`: protobuf `string` and `bytes` share one wire
//! encoding, so any request decodes, while a `string` field would turn bytes that are not UTF-8
//! (which Envoy forwards from request headers as they came) into a decode error. A quota report's
//! bucket usages, and an answer's bucket actions, are declared `bytes` too, for the same reason (a
//! nested message and bytes share one encoding): each usage is decoded when it is handled, so a
//! waiting report takes its size on the wire, not the several times more of its decoded maps; and
//! each action is encoded where it is decided, not on the event loop that writes the answer.

use prost::Message;
use prost_types::DescriptorProto;
use prost_types::field_descriptor_proto::Type;

const RLS: &str = "envoy/service/ratelimit/v3/rls.proto";
const RLQS: &str = "envoy/service/rate_limit_quota/v3/rlqs.proto";
const DESCRIPTOR: &str = "envoy/extensions/common/ratelimit/v3/ratelimit.proto";

fn main() {
    let set = protox::compile([RLS, RLQS], ["proto"]).expect("proto/ compiles");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    std::fs::write(out.join("descriptors.bin"), set.encode_to_vec()).expect("OUT_DIR is writable");

    let mut generated = set;
    for file in &mut generated.file {
        // No comments: upstream's reStructuredText is not rustdoc.
        file.source_code_info = None;
        if file.name() == DESCRIPTOR {
            // The rest of the file is for Envoy's local rate limit filter.
            file.message_type
                .retain(|m| m.name() == "RateLimitDescriptor");
        }
        for message in &mut file.message_type {
            match message.name() {
                "RateLimitRequest" => as_bytes(message, &["domain"]),
                "RateLimitDescriptor" => message
                    .nested_type
                    .iter_mut()
                    .filter(|m| m.name() == "Entry")
                    .for_each(|entry| as_bytes(entry, &["key", "value"])),
                // A map's values may be bytes; its keys may not (and Envoy's configuration names
                // them).
                "RateLimitQuotaUsageReports" => encoded(message, "bucket_quota_usages"),
                "RateLimitQuotaResponse" => encoded(message, "bucket_action"),
                "BucketId" => message
                    .nested_type
                    .iter_mut()
                    .filter(|m| m.name() == "BucketEntry")
                    .for_each(|entry| as_bytes(entry, &["value"])),
                _ => {}
            }
        }
    }
    tonic_prost_build::configure()
        .build_client(false)
        .include_file("rls.rs")
        .compile_well_known_types(true)
        .bytes(".envoy.service.rate_limit_quota.v3.RateLimitQuotaUsageReports.bucket_quota_usages")
        .bytes(".envoy.service.rate_limit_quota.v3.RateLimitQuotaResponse.bucket_action")
        .extern_path(".google.protobuf", "::envoy_types::pb::google::protobuf")
        .extern_path(".envoy.config", "::envoy_types::pb::envoy::config")
        .extern_path(".envoy.type", "crate::pb::envoy_type")
        .extern_path(".validate", "::envoy_types::pb::validate")
        .extern_path(".udpa", "::envoy_types::pb::udpa")
        .extern_path(".xds", "::envoy_types::pb::xds")
        .compile_fds(generated)
        .expect("the rate limit services generate");
    println!("cargo:rerun-if-changed=proto");
}

/// Declares the named `string` fields of `message` as `bytes`.
fn as_bytes(message: &mut DescriptorProto, names: &[&str]) {
    for field in &mut message.field {
        if names.contains(&field.name()) {
            assert_eq!(field.r#type(), Type::String, "{} is a string", field.name());
            field.set_type(Type::Bytes);
        }
    }
}

/// Declares the message field `name` of `message` as `bytes`: its messages stay encoded.
fn encoded(message: &mut DescriptorProto, name: &str) {
    let field = message
        .field
        .iter_mut()
        .find(|f| f.name() == name)
        .unwrap_or_else(|| {
            panic!(
                "{} has a field {name}",
                message.name.as_deref().unwrap_or("")
            )
        });
    assert_eq!(field.r#type(), Type::Message, "{name} is a message");
    field.set_type(Type::Bytes);
    field.type_name = None;
}
