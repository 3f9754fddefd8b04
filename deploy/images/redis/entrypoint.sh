#!/bin/sh
# As the official image does: without a config file Redis starts in protected mode and refuses
# other containers, so a bare `redis-server ...` command gets `--protected-mode no` first.
set -eu
if [ "$1" = redis-server ]; then
  shift
  set -- redis-server --protected-mode no "$@"
fi
exec "$@"
