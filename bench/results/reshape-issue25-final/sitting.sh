#!/usr/bin/env bash
# before/after in one sitting, alternately. $1: after worktree, out dir $2
set -u
BEFORE=/tmp/s32/before; AFTER=$1; OUT=$2; mkdir -p $OUT
PY=/work/main/.venv/bin/python
run() { # side root name args...
  local side=$1 root=$2 name=$3; shift 3
  echo "$(date +%T) $side $name $*" >> $OUT/sitting.log
  (cd $root && PYTHONPATH=$root:$root/proto nice -n -10 $PY -m bench.$name "$@" --output $OUT/$name-$side$SUF.json > $OUT/$name-$side$SUF.log 2>&1; echo "rc=$?" >> $OUT/$name-$side$SUF.log)
}
for i in 1 2; do SUF=-$i
  run before $BEFORE ingest --agents 2000 --aggregator-root $BEFORE
  run after $AFTER ingest --agents 2000 --aggregator-root $AFTER
done
SUF=""
run before $BEFORE detection
run after $AFTER detection
for i in 1 2 3; do SUF=-$i
  run before $BEFORE mass_hang --trials 1
  run after $AFTER mass_hang --trials 1
done
SUF=""
run before $BEFORE failover --kills 3
run after $AFTER failover --kills 3 --lease-duration 3 --renew-deadline 2 --retry-period 0.5
echo "$(date +%T) done" >> $OUT/sitting.log
