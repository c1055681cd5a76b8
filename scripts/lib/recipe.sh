# shellcheck shell=bash
# Named recipes: scripts/recipes/<name>.sh, the hyper-parameters of one global batch (those of the
# MLPerf 4.0.0 RCP at that batch, or the reference's 1-GPU run, gbs2). Sourced by run_and_time.sh
# and scripts/slurm/common.sh.
#
# recipe_args PROCESSES FLAGS...: the main.py flags of RECIPE (an environment variable named as a
# recipe's setting wins over the recipe, said in one line on stderr) for PROCESSES training
# processes: the recipe fixes the global batch, BATCH_SIZE per process is GLOBAL_BATCH_SIZE /
# (PROCESSES x GA_STEPS), refused in one line when that does not divide. Without RECIPE: the
# reference's 1-GPU hyper-parameters (gbs2) at BATCH_SIZE per process (default 2), as before
# recipes existed, and one line on stderr saying that no RCP stands behind them. FLAGS: the
# user's own main.py flags, where a RECIPE refuses --batch_size and --ga_steps other than the
# derived values. Sets the array RECIPE_ARGS; exports UNET3D_RECIPE (the recipe's name, recorded in the run), unset without.
# With a RECIPE, each of its values that the environment or one of FLAGS (given in full, `--flag V` or
# `--flag=V`; they come after the recipe's, so main.py takes them) overrides is said in a line of its
# own on stderr and listed in UNET3D_RECIPE_OVERRIDES (recorded in the run's run_description.json;
# the package's README lists them).

RECIPES_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/../recipes" && pwd)
RECIPE_VARS=(GLOBAL_BATCH_SIZE OPTIMIZER LEARNING_RATE INIT_LEARNING_RATE LR_WARMUP_EPOCHS LR_DECAY_EPOCHS
    LR_DECAY_FACTOR MOMENTUM WEIGHT_DECAY)
# main.py's flag of each recipe setting (the batch's are checked apart: a recipe fixes the global batch)
RECIPE_FLAGS=(--optimizer=OPTIMIZER --learning_rate=LEARNING_RATE --init_learning_rate=INIT_LEARNING_RATE
    --lr_warmup_epochs=LR_WARMUP_EPOCHS --lr_decay_epochs=LR_DECAY_EPOCHS --lr_decay_factor=LR_DECAY_FACTOR
    --momentum=MOMENTUM --weight_decay=WEIGHT_DECAY)
DEFAULT_RECIPE=gbs2

recipe_fail() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}

# recipe_names NAME: the recipes there are, comma-separated, into variable NAME (no $(...): the
# SLURM jobs' USR1 trap, see scripts/slurm/common.sh).
recipe_names() {
    local file found=
    for file in "$RECIPES_DIR"/*.sh; do
        file=${file##*/}
        found+=${found:+, }${file%.sh}
    done
    printf -v "$1" "%s" "$found"
}

# same_value A B: A and B are the same setting (equal as numbers, or as text)
same_value() {
    [[ $1 == "$2" ]] || awk -v a="$1" -v b="$2" \
        'BEGIN { n = "^[-+]?([0-9]+[.]?[0-9]*|[.][0-9]+)([eE][-+]?[0-9]+)?$"; exit !(a ~ n && b ~ n && a + 0 == b + 0) }'
}

# flag_overrides FLAGS...: each recipe setting a flag of FLAGS sets to another value, appended to the
# array `overridden` ("--flag VALUE (was VALUE)": the recipe's, or the environment's that overrode it);
# a multi-valued flag (--lr_decay_epochs)
# takes the words up to the next flag. No $(...): the SLURM jobs' USR1 trap (scripts/slurm/common.sh).
flag_overrides() {
    local i=1 token name value pair var
    while (( i <= $# )); do
        token=${!i}
        i=$(( i + 1 ))
        [[ $token == --* ]] || continue
        name=${token%%=*} value=
        var=
        for pair in "${RECIPE_FLAGS[@]}"; do
            [[ ${pair%%=*} == "$name" ]] && var=${pair#*=}
        done
        [[ -n $var ]] || continue
        if [[ $token == *=* ]]; then
            value=${token#*=}
        else
            while (( i <= $# )) && [[ ${!i} != --* ]]; do
                value+=${value:+ }${!i}
                i=$(( i + 1 ))
            done
        fi
        if ! same_value "$value" "${!var-}"; then
            overridden+=("$name $value (was ${!var:-none})")
        fi
    done
}

recipe_args() {
    local processes=$1
    shift
    local name=${RECIPE:-$DEFAULT_RECIPE} var kept=() overridden=() flag
    if [[ ! $name =~ ^[A-Za-z0-9_.-]+$ || ! -f $RECIPES_DIR/$name.sh ]]; then
        local names
        recipe_names names
        recipe_fail "RECIPE=$name: no such recipe in $RECIPES_DIR (recipes: $names)"
    fi
    # What the environment sets wins over the recipe.
    for var in "${RECIPE_VARS[@]}"; do
        if [[ -n ${!var+x} ]]; then
            kept+=("$var=${!var}")
        fi
    done
    local RECIPE_RCP=none
    # shellcheck source=/dev/null
    source "$RECIPES_DIR/$name.sh"
    if [[ -z ${RECIPE:-} ]]; then
        unset GLOBAL_BATCH_SIZE  # no RECIPE: the batch per process, as before recipes
    fi
    for var in ${kept[@]+"${kept[@]}"}; do
        local key=${var%%=*} value=${var#*=}
        if [[ -n ${RECIPE:-} && ${!key-} != "$value" ]]; then
            overridden+=("$key=$value (the recipe: ${!key-})")
        fi
        printf -v "$key" '%s' "$value"
    done
    local ga=${GA_STEPS:-1}
    [[ $processes =~ ^[1-9][0-9]*$ ]] || recipe_fail "the process count must be a positive integer, got '$processes'"
    [[ $ga =~ ^[1-9][0-9]*$ ]] || recipe_fail "GA_STEPS must be a positive integer, got '$ga'"
    local batch
    if [[ -n ${GLOBAL_BATCH_SIZE:-} ]]; then
        [[ $GLOBAL_BATCH_SIZE =~ ^[1-9][0-9]*$ ]] ||
            recipe_fail "GLOBAL_BATCH_SIZE must be a positive integer, got '$GLOBAL_BATCH_SIZE'"
        (( GLOBAL_BATCH_SIZE % (processes * ga) == 0 )) ||
            recipe_fail "RECIPE=$name: global batch $GLOBAL_BATCH_SIZE does not divide into $processes process(es)" \
                "x GA_STEPS=$ga (choose a process count and GA_STEPS whose product divides it)"
        batch=$(( GLOBAL_BATCH_SIZE / (processes * ga) ))
        if [[ -n ${BATCH_SIZE:-} && $BATCH_SIZE != "$batch" ]]; then
            recipe_fail "RECIPE=$name: BATCH_SIZE=$BATCH_SIZE, but global batch $GLOBAL_BATCH_SIZE on $processes" \
                "process(es) x GA_STEPS=$ga is $batch per process (leave BATCH_SIZE unset)"
        fi
        # --batch_size / --ga_steps among the flags: only the derived values (a packed launch script
        # repeats the flags its run logged); another value would change the recipe's global batch
        local flag previous='' given
        for flag in "$@"; do
            given=
            case $previous in --batch_size | --ga_steps) given=$previous=$flag ;; esac
            case $flag in --batch_size=* | --ga_steps=*) given=$flag ;; esac
            previous=$flag
            [[ -n $given ]] || continue
            local want=$batch
            [[ $given == --ga_steps=* ]] && want=$ga
            [[ ${given#*=} == "$want" ]] ||
                recipe_fail "RECIPE=$name fixes the global batch ($GLOBAL_BATCH_SIZE): ${given%%=*} ${given#*=} is" \
                    "not the derived $want; give the gradient accumulation as GA_STEPS (the batch per process is derived)"
        done
    else
        batch=${BATCH_SIZE:-2}
        [[ $batch =~ ^[1-9][0-9]*$ ]] || recipe_fail "BATCH_SIZE must be a positive integer, got '$batch'"
    fi
    local global=$(( batch * processes * ga ))
    if [[ -z ${RECIPE:-} ]]; then
        local line="warning: no RECIPE: the reference's 1-GPU hyper-parameters (scripts/recipes/$DEFAULT_RECIPE.sh)"
        line+=" at batch $batch per process, global batch $global: no MLPerf 4.0.0 RCP stands behind them"
        printf '%s (RECIPE=gbs28, gbs56, gbs64 or gbs84 has one)\n' "$line" >&2
        unset UNET3D_RECIPE UNET3D_RECIPE_OVERRIDES
    else
        local environment_count=${#overridden[@]} said=
        flag_overrides "$@"
        local index=0 item
        for item in ${overridden[@]+"${overridden[@]}"}; do
            if (( index < environment_count )); then
                printf 'warning: RECIPE=%s (RCP %s): %s from the environment overrides the recipe'"'"'s value\n' \
                    "$name" "$RECIPE_RCP" "$item" >&2
            else
                printf 'warning: RECIPE=%s (RCP %s): the flag %s, given after the recipe'"'"'s, overrides its value\n' \
                    "$name" "$RECIPE_RCP" "$item" >&2
            fi
            said+=${said:+; }$item
            index=$(( index + 1 ))
        done
        export UNET3D_RECIPE=$name
        if [[ -n $said ]]; then
            export UNET3D_RECIPE_OVERRIDES=$said
        else
            unset UNET3D_RECIPE_OVERRIDES
        fi
    fi
    RECIPE_ARGS=(
        --optimizer "$OPTIMIZER"
        --learning_rate "$LEARNING_RATE"
        --init_learning_rate "$INIT_LEARNING_RATE"
        --lr_warmup_epochs "$LR_WARMUP_EPOCHS"
        --momentum "$MOMENTUM"
        --weight_decay "$WEIGHT_DECAY"
        --lr_decay_factor "$LR_DECAY_FACTOR"
    )
    if [[ -n ${LR_DECAY_EPOCHS:-} ]]; then
        local decay=()
        read -r -a decay <<< "$LR_DECAY_EPOCHS"
        RECIPE_ARGS+=(--lr_decay_epochs "${decay[@]}")
    fi
    RECIPE_ARGS+=(--batch_size "$batch" --ga_steps "$ga")
}
