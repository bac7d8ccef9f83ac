"""P2P store: etcd-coordinated swarm distribution of large blobs (checkpoints)."""
