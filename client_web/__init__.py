"""The browser page the server serves at `/` (index.html, app.js, style.css): package data, so that an installed
server finds it where it was installed (server/transports/webrtc/config.py)."""
