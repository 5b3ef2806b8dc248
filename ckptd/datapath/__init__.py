"""The data path, in save order: slots, flush and seal, progress, replicas, uploads, locate, retention, status."""
