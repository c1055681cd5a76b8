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

RECIPES_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/../recipes" && pwd)
RECIPE_VARS=(GLOBAL_BATCH_SIZE OPTIMIZER LEARNING_RATE INIT_LEARNING_RATE LR_WARMUP_EPOCHS LR_DECAY_EPOCHS
    LR_DECAY_FACTOR MOMENTUM WEIGHT_DECAY)
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
        unset UNET3D_RECIPE
    else
        if (( ${#overridden[@]} )); then
            local IFS=';'
            printf 'warning: RECIPE=%s (RCP %s) with settings from the environment: %s\n' "$name" "$RECIPE_RCP" \
                "${overridden[*]}" >&2
        fi
        export UNET3D_RECIPE=$name
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
