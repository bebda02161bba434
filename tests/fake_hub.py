"""A real HTTP server on 127.0.0.1 speaking the parts of the Hugging Face Hub API that an upload
uses: repo creation, pre-upload (regular vs LFS), the LFS batch API and PUT, and the commit.
Point huggingface_hub at it with HF_ENDPOINT (and HF_HUB_DISABLE_XET=1: Xet storage is not
spoken here)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeHub:
    def __init__(self, token="hf_test_token", fail_commits=0, drop_commits=0):
        self.token = token
        self.fail_commits = fail_commits  # first N commits answer 500 (the client retries)
        self.drop_commits = drop_commits  # then N commits lose their connection, unanswered
        self.repos: dict[
            str, dict
        ] = {}  # repo_id -> {"private", "files": {path: bytes}, "commits": [...]}
        self.lfs: dict[str, bytes] = {}
        self.unknown: list[str] = []
        self.card_metadata: dict | None = None
        self.auth_headers: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length", 0)))

            def _authorized(self) -> bool:
                auth = self.headers.get("Authorization", "")
                hub.auth_headers.append(auth)
                if auth != f"Bearer {hub.token}":
                    self._send(401, {"error": "Invalid credentials in Authorization header"})
                    return False
                return True

            def do_PUT(self):
                m = re.fullmatch(r"/lfs-upload/([0-9a-f]{64})", self.path)
                data = self._body()
                if not m:
                    hub.unknown.append(f"PUT {self.path}")
                    return self._send(404, {"error": "not found"})
                if hashlib.sha256(data).hexdigest() != m.group(1):
                    return self._send(400, {"error": "sha256 mismatch"})
                hub.lfs[m.group(1)] = data
                self._send(200, {})

            def do_POST(self):
                raw = self._body()
                if not self._authorized():
                    return
                path = self.path.split("?")[0]
                if path == "/api/validate-yaml":  # the model card's metadata block
                    import yaml

                    content = json.loads(raw)["content"]
                    try:
                        meta = (
                            yaml.safe_load(content.split("---")[1])
                            if content.startswith("---")
                            else {}
                        )
                    except yaml.YAMLError as exc:
                        return self._send(400, {"errors": [{"message": str(exc)}]})
                    hub.card_metadata = meta
                    return self._send(200, {"errors": [], "warnings": []})
                if path == "/api/repos/create":
                    body = json.loads(raw)
                    repo_id = (
                        f"{body['organization']}/{body['name']}"
                        if body.get("organization")
                        else body["name"]
                    )
                    if repo_id in hub.repos:
                        return self._send(
                            409,
                            {
                                "error": "You already created this model repo",
                                "url": f"{hub.url}/{repo_id}",
                            },
                        )
                    private = body.get("private", body.get("visibility") == "private")
                    hub.repos[repo_id] = {"private": private, "files": {}, "commits": []}
                    return self._send(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id})
                m = re.fullmatch(r"/api/models/(.+)/preupload/([^/]+)", path)
                if m:
                    files = json.loads(raw)["files"]
                    return self._send(
                        200,
                        {
                            "files": [
                                {
                                    "path": f["path"],
                                    "uploadMode": "lfs"
                                    if f["path"].endswith(".safetensors")
                                    else "regular",
                                    "shouldIgnore": False,
                                }
                                for f in files
                            ]
                        },
                    )
                m = re.fullmatch(r"/(.+)\.git/info/lfs/objects/batch", path)
                if m:
                    objs = json.loads(raw)["objects"]
                    return self._send(
                        200,
                        {
                            "transfer": "basic",
                            "objects": [
                                {
                                    "oid": o["oid"],
                                    "size": o["size"],
                                    "authenticated": True,
                                    "actions": {
                                        "upload": {"href": f"{hub.url}/lfs-upload/{o['oid']}"}
                                    },
                                }
                                for o in objs
                            ],
                        },
                    )
                m = re.fullmatch(r"/api/models/(.+)/commit/([^/]+)", path)
                if m:
                    repo = hub.repos.get(m.group(1))
                    if repo is None:
                        return self._send(404, {"error": "Repository not found"})
                    if hub.fail_commits > 0:
                        hub.fail_commits -= 1
                        return self._send(500, {"error": "internal error"})
                    if hub.drop_commits > 0:
                        hub.drop_commits -= 1
                        self.close_connection = True
                        self.connection.shutdown(2)
                        return
                    summary, staged = None, {}
                    for line in raw.decode().splitlines():
                        item = json.loads(line)
                        v = item["value"]
                        if item["key"] == "header":
                            summary = v["summary"]
                        elif item["key"] == "file":
                            staged[v["path"]] = base64.b64decode(v["content"])
                        elif item["key"] == "lfsFile":
                            if v["oid"] not in hub.lfs:
                                return self._send(
                                    422, {"error": f"LFS object {v['oid']} was never uploaded"}
                                )
                            staged[v["path"]] = hub.lfs[v["oid"]]
                    repo["files"].update(staged)
                    oid = hashlib.sha1(
                        json.dumps(sorted(staged)).encode() + str(len(repo["commits"])).encode()
                    ).hexdigest()
                    repo["commits"].append(
                        {"summary": summary, "oid": oid, "files": sorted(staged)}
                    )
                    return self._send(
                        200, {"commitUrl": f"{hub.url}/{m.group(1)}/commit/{oid}", "commitOid": oid}
                    )
                hub.unknown.append(f"POST {path}")
                self._send(404, {"error": "not found"})

            def do_GET(self):
                hub.unknown.append(f"GET {self.path}")
                self._send(404, {"error": "not found"})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
