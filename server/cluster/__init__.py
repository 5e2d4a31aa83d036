"""The server on Ray Serve, for many hosts: engines as GPU replicas, the realtime front end as CPU replicas behind
Ray Serve's HAProxy ingress (`moss-speech serve --ray ADDRESS`, or `serve run docker/ray-serve.yaml`). Imports Ray:
install the `ray` extra."""
