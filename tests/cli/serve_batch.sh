#!/usr/bin/env bash
# tests/cli/serve.sh again with every server on the continuous-batching scheduler
# (kvzip-serve --max-batch 4; on the CPU a step decodes the 4 requests one after
# another), and the issue's load: 16 concurrent clients x 50 streaming requests (4
# tokens each, to keep the test within minutes on 2 cores), 0 errors, every answer
# equal to the one a request alone gets, p50/p99 TTFT and tokens/s printed.
export KVZ_SERVE_BATCH=4 KVZ_SERVE_LOAD="16 50 4"
exec bash "$(dirname "$0")/serve.sh"
