"""The contract between trainers and the service, torch-free: what crosses the wire and
what lies in the store.

It imports nothing else of lastgood (an import-linter contract checks it), and the
service imports lastgood only through it and lastgood.common.

    codes       error codes, and the HTTP status and gRPC code each travels with
    vocab       the status, verification-mode and heartbeat-phase vocabularies
    errors      the contract's own errors (LastgoodError, FormatError)
    names       names and integer bounds of user values; the spool's hand-over names
    hashing     xxh3-128, the one content hash
    jsonvalues  what a stored JSON value may hold
    format      the shard file (a safetensors file)
    manifest    the manifest: root, index objects, format 1
    layout      where one file's DTensor shards lie
    ranges      range digests: any byte range of a file verified alone
    framing     shard chunks framed by hand on the gRPC stream
    s3parts     how a file is cut into S3 multipart parts
    info        the typed GET /api/v1/info document
    v1          the generated protobuf and gRPC stubs

docs/format.md specifies the formats these modules read and write.
"""
