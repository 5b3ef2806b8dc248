"""Stubs of etcd's v3 API, generated from protos/ckptd/cluster/etcd_wire/ (kv, watch, lease) (scripts/gen_protos.sh)."""
