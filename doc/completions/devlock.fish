# Resource names, hand-written (doc/completions/devlock.fish): a RESOURCE is
# the name of a lock file in the scratch directory, less its .lock suffix.
# The __devlock_* helpers above it are generated from the clap definitions.

# Whether the word being completed is a RESOURCE: not an option or an
# option's value, not after `--`, at the top level or after a subcommand that
# takes resources (devlock status).
function __devlock_wants_resource
    string match -q -- '-*' (commandline -ct); and return 1
    set -l words (commandline -opc)
    set -e words[1]
    set -l pending 0
    set -l positionals 0
    set -l sub
    for word in $words
        if test $pending = 1
            set pending 0
        else if test "$word" = --
            return 1
        else if string match -q -- '-*' $word
            __devlock_takes_value $word; and set pending 1
        else
            if test $positionals = 0; and __devlock_is_subcommand $word
                set sub $word
            end
            set positionals (math $positionals + 1)
        end
    end
    test $pending = 1; and return 1
    if test -n "$sub"; and not __devlock_lists_resources $sub
        return 1
    end
    return 0
end

# Prints the resource names in the scratch directory: --dir DIR already on
# the line, else $DEVLOCK_DIR, else /run/lock/devlock.
function __devlock_resources
    set -l dir /run/lock/devlock
    test -n "$DEVLOCK_DIR"; and set dir $DEVLOCK_DIR
    set -l words (commandline -opc)
    set -l next 0
    for word in $words
        if test $next = 1
            set dir $word
            set next 0
        else if test "$word" = --
            break
        else if test "$word" = --dir
            set next 1
        else if string match -q -- '--dir=*' $word
            set dir (string replace -- '--dir=' '' $word)
        end
    end
    set dir (string replace -r -- '^~' $HOME $dir)
    for file in $dir/*.lock
        test -f $file; and string replace -r -- '^.*/(.*)\.lock$' '$1' $file
    end
end

complete -c devlock -n __devlock_wants_resource -f -a '(__devlock_resources)' -d resource

# After `--`: the command, then that command's own arguments, the way the
# completions of sudo and timeout do it.
function __devlock_after_dashdash
    contains -- -- (commandline -opc)
end

function __devlock_complete_command
    set -l words (commandline -opc)
    set -l at (contains -i -- -- $words)
    if test $at -ge (count $words)
        # The command's name. (A range past the end would run backwards in
        # fish, and __fish_complete_subcommand takes an empty line for none.)
        set -l token (commandline -ct)
        complete -C "$token"
        return
    end
    __fish_complete_subcommand --commandline $words[(math $at + 1)..-1] (commandline -ct)
end

complete -c devlock -n __devlock_after_dashdash -f -a '(__devlock_complete_command)'

# A duration or a number completes nothing, not even file names. (clap's
# own entry for the option says so too, but its condition fails while the
# option still waits for its value.)
function __devlock_value_pending_is_free
    set -l words (commandline -opc)
    __devlock_value_is_free $words[-1]
end

complete -c devlock -n __devlock_value_pending_is_free -f
