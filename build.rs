//! Compiles `proto/` into one file descriptor set, embedded in the binary for gRPC server
//! reflection and for the protobuf JSON mapping of the admin `/json` endpoint.

use prost::Message;

fn main() {
    let roots = ["proto/envoy/service/ratelimit/v3/rls.proto"];
    let set = protox::compile(roots, ["proto"]).expect("proto/ compiles");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    std::fs::write(out.join("descriptors.bin"), set.encode_to_vec()).expect("OUT_DIR is writable");
    println!("cargo:rerun-if-changed=proto");
}
