"""Stubs of etcd's v3 API, generated from protos/ckptd/cluster/etcd_wire/rpc.proto (scripts/gen_protos.sh)."""
